"""Compute: one `dagster_ray.RayResource` interface, embedded locally or on a cluster.

`EmbeddedRay` is dagster-ray's `LocalRay` that reuses a Ray already started in this process
(the CLI and the tests start one for many materializations; Ray takes seconds to start); one it
starts itself listens on loopback only (prx_core.compute.loopback).
`RayCluster` connects to a running cluster by address and, given the cluster's job server
(`jobs_address`), runs every stage as a Ray job through Dagster Pipes: runs that last days do not
hang on one Ray Client connection, and terminating the Dagster run stops the job. On Kubernetes use
dagster-ray's `KubeRayCluster` (see deploy/README.md), which shares the interface.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import dagster as dg
from dagster_ray import Lifecycle, LocalRay, RayResource
from pydantic import Field, PrivateAttr, field_validator

from prx_core.compute import wire
from prx_core.compute.loopback import loopback_node, wants_loopback
from prx_core.compute.quiet import quiet_ray_start
from prx_core.stages import entry
from prx_core.stages.job import REPORT_KEY
from prx_core.store.credentials import refuse_literal_secrets
from prx_core.store.locks import RUN_LABEL

NO_AGENT = "No available agent to submit job"  # Ray's job server before its agent registered (HTTP 500)


def never_cleanup() -> Lifecycle:
    """An embedded Ray has nothing to delete (it stops with the process). Pass it explicitly:
    Dagster does not apply a field's default factory inside runs."""
    return Lifecycle(cleanup="never")


def default_init_options() -> dict[str, Any]:
    return {"include_dashboard": False, "logging_level": "warning", "log_to_driver": True}


class ReusesRay:
    """Connect only when this process has no Ray yet: the CLI and the tests connect once for many
    materializations, and a second ray.init fails ("Maybe you called ray.init twice")."""

    def connect(self, context: Any) -> Any:
        import ray

        if ray.is_initialized():
            self._reused = True
            return None
        local = isinstance(self, LocalRay)
        loopback = local and wants_loopback(getattr(self, "ray_init_options", {}))
        with quiet_ray_start(local=local), loopback_node(loopback):  # no token notice, no Lance fork warnings
            return super().connect(context)  # type: ignore[misc]


class EmbeddedRay(ReusesRay, LocalRay):
    """A Ray started inside the Dagster process (or the one already running there), listening on
    loopback only unless `ray_init_options` name a routable `_node_ip_address`."""

    ray_init_options: dict[str, Any] = Field(
        default_factory=default_init_options, description="Keyword arguments for ray.init (num_cpus, ...)."
    )
    lifecycle: Lifecycle = Field(default_factory=never_cleanup, description="Keep `never`: see never_cleanup().")
    _reused: bool = PrivateAttr(default=False)

    @field_validator("ray_init_options")
    @classmethod
    def _no_secret_values(cls, value: dict[str, Any]) -> dict[str, Any]:
        """Stored in every run's job snapshot: a runtime_env token there would be persisted."""
        refuse_literal_secrets(value, "ray.ray_init_options")
        return value

    def on_connect(self, context: Any) -> None:
        context.log.info("Reusing the Ray already running in this process" if self._reused else "Started embedded Ray")


class RayCluster(ReusesRay, RayResource):
    """An existing Ray cluster, e.g. `ray://head:10001` or `auto` on a cluster node. A process
    already connected (`prx-corpus build` connects to this address once) is reused."""

    address: str = Field(description="Ray address passed to ray.init.")
    jobs_address: str | None = Field(default=None, description=(
        "The cluster's job server (dashboard), e.g. http://head:8265. When set, each stage runs as a Ray job "
        "(`python -m prx_core.stages.job`, logs, progress and its report through Dagster Pipes); terminating the "
        "Dagster run stops the job. Unset: stages run in the Dagster run's process over `address`."))
    job_python: str = Field(default="python", description="The Python that runs a stage job on the head node.")
    job_runtime_env: dict[str, Any] = Field(default_factory=dict, description=(
        "Ray runtime_env of every stage job (env_vars, ...); names of secrets only, never their values."))
    job_num_cpus: float = Field(default=0, ge=0, description=(
        "CPUs reserved for a stage job's driver (0: it only plans and waits; the units take the CPUs)."))
    job_poll_seconds: float = Field(default=2.0, gt=0, description="How often the run polls a stage job's status.")
    job_server_wait_seconds: float = Field(default=180.0, ge=0, description=(
        "How long a submission waits for a job server that has no agent yet (a head just started or scaled)."))
    _reused: bool = PrivateAttr(default=False)

    @field_validator("job_runtime_env")
    @classmethod
    def _no_secret_env(cls, value: dict[str, Any]) -> dict[str, Any]:
        refuse_literal_secrets(value, "ray.job_runtime_env")
        return value

    def submit_stage(self, context: dg.AssetExecutionContext, stage: str, kwargs: dict[str, Any]) -> Any:
        """Run `stage` as a Ray job and return its report; the job's log lines become run logs. The
        report is the one Pipes message signed with a key made for this job alone."""
        from dagster_ray.core.pipes import PipesRayJobClient

        client = PipesRayJobClient(address=self.jobs_address, poll_interval=self.job_poll_seconds)
        key = secrets.token_hex(32)
        extras = {"stage": stage, "kwargs": wire.encode(kwargs), REPORT_KEY: key,
                  "run_label": RUN_LABEL.get() or f"dagster run {context.run.run_id}"}
        deadline = time.monotonic() + self.job_server_wait_seconds
        while True:
            params = {"entrypoint": f"{self.job_python} -m prx_core.stages.job", "entrypoint_num_cpus": self.job_num_cpus,
                      "runtime_env": {**self.job_runtime_env, "env_vars": dict(self.job_runtime_env.get("env_vars") or {})},
                      "metadata": {"prx_stage": stage}}  # fresh each attempt: the client adds to it
            try:
                invocation = client.run(context=context, submit_job_params=params, extras=extras)  # type: ignore[arg-type]
                break
            except RuntimeError as exc:  # refused before any job exists: nothing to clean up
                if NO_AGENT not in str(exc) or time.monotonic() > deadline:
                    raise
                context.log.warning(f"the job server {self.jobs_address} has no agent yet; submitting again in 5 s")
                time.sleep(5)
        messages = invocation.get_custom_messages()
        job_id = getattr(invocation.metadata.get("Ray Job ID"), "value", "")
        if forged := wire.unsigned_reports(messages, key, stage):
            context.log.warning(f"Ray job {job_id} of stage {stage}: refused {forged} report line(s) not signed with "
                                "this run's key (printed into the job's log by something other than the stage)")
        try:
            report = wire.open_report(messages, key, stage, entry.report_type(stage))
        except wire.WireError as exc:
            raise dg.Failure(f"Ray job {job_id}: {exc} (see its logs above)") from exc
        context.add_asset_metadata({"ray_job_id": str(job_id)})
        return report

    @property
    def host(self) -> str:
        return self.address.split("://")[-1].split(":")[0]

    @property
    def ray_address(self) -> str:  # type: ignore[override]
        return self.address

    @property
    def name(self) -> str:
        return f"RayCluster({self.address})"

    @property
    def created(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return True


def run_stage(context: dg.AssetExecutionContext, ray: RayResource, stage: str, **kwargs: Any) -> Any:
    """Run a `prx_core` stage (prx_core.stages.entry): as a Ray job when the cluster has a job
    server, otherwise in this process; either way the same call with the same arguments."""
    if isinstance(ray, RayCluster) and ray.jobs_address:
        return ray.submit_stage(context, stage, kwargs)
    return entry.run_stage(stage, kwargs, context.log.info)
