"""Compute: one `dagster_ray.RayResource` interface, embedded locally or on a cluster.

`EmbeddedRay` is dagster-ray's `LocalRay` that reuses a Ray already started in this process
(the CLI and the tests start one for many materializations; Ray takes seconds to start).
`RayCluster` connects to a running cluster by address; on Kubernetes use dagster-ray's
`KubeRayCluster` (see deploy/README.md), which shares the interface.
"""

from __future__ import annotations

from typing import Any

from dagster_ray import Lifecycle, LocalRay, RayResource
from pydantic import Field, PrivateAttr, field_validator

from prx_core.store.credentials import refuse_literal_secrets


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
        return super().connect(context)  # type: ignore[misc]


class EmbeddedRay(ReusesRay, LocalRay):
    """A Ray started inside the Dagster process (or the one already running there)."""

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
    _reused: bool = PrivateAttr(default=False)

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
