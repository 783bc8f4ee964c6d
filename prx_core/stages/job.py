"""`python -m prx_core.stages.job`: the entrypoint of a stage submitted as a Ray job.

The Dagster run (prx_resources.ray.RayCluster with `jobs_address`) submits this module through
dagster-ray's `PipesRayJobClient`; the stage name and its arguments arrive as Pipes extras. The
job connects to the cluster it runs on, runs `run_stage` (the same call an asset makes in its own
process), streams log and progress lines, and sends the report back as one Pipes message signed
with the run's secret (the `report_key` extra; HMAC, `wire.sign_report`): the run accepts only that
message, so a report-shaped line printed into the job's log by anything else is refused.

`dagster_pipes` is Dagster's dependency-free protocol library for external processes, not
Dagster itself: prx_core stays importable without dagster.
"""

from __future__ import annotations

import logging

from prx_core.compute import wire
from prx_core.stages.entry import report_type, run_stage
from prx_core.store.locks import RUN_LABEL

REPORT, REPORT_KEY = wire.REPORT, "report_key"


def main() -> None:
    import ray
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        stage, key = pipes.get_extra("stage"), pipes.get_extra(REPORT_KEY)
        report_type(stage)  # an unknown stage fails before Ray starts
        kwargs = wire.decode(pipes.get_extra("kwargs"))
        RUN_LABEL.set(pipes.get_extra("run_label"))  # partition locks name the Dagster run, not this pid
        if not ray.is_initialized():  # the job's driver: RAY_ADDRESS names the cluster it was submitted to
            ray.init(address="auto", logging_level=logging.WARNING, log_to_driver=True)
        pipes.log.info(f"{stage}: Ray job on {sum(n['Alive'] for n in ray.nodes())} node(s)")
        report = run_stage(stage, kwargs, pipes.log.info)
        pipes.report_custom_message(wire.sign_report(key, stage, report))


if __name__ == "__main__":
    from prx_core.compute.exits import exit_now

    main()  # an exception exits non-zero the usual way: the job FAILED, its traceback in the log
    exit_now(0)  # reported and closed: an Arrow thread finishing at finalization must not fail the job
