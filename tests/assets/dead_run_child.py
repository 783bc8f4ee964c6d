"""A `run_build` of the stand-in assets' `captions` (pool `gpu`) that pauses inside the step, for
test_dead_runs: `python dead_run_child.py <dagster home>`; prints `PRX-PAUSED-AT captions` and
sleeps while holding the pool's only slot, until the test kills it."""

import sys
from pathlib import Path

import dagster as dg

sys.path.insert(0, str(Path(__file__).parent))
from test_build_outcome import DEPS, stand_ins  # noqa: E402

from prx_cli.build import run_build  # noqa: E402
from prx_assets.common import SOURCES  # noqa: E402
from prx_core.compute.faults import pause_point  # noqa: E402


def assets(pause: bool) -> list[dg.AssetsDefinition]:
    """The stand-ins with a `captions` in the `gpu` pool (as the real one), pausing when `pause`."""
    @dg.asset(name="captions", deps=DEPS["captions"], partitions_def=SOURCES, pool="gpu")
    def captions(context: dg.AssetExecutionContext) -> None:
        context.log.info(f"captions[{context.partition_key}]: 1/1 units")
        if pause:
            pause_point("captions")

    return [*(a for a in stand_ins({}) if a.key.to_user_string() != "captions"), captions]


if __name__ == "__main__":
    instance = dg.DagsterInstance.from_config(sys.argv[1])
    outcome = run_build(dg.Definitions(assets=assets(pause=True)), instance, ["photos"], None, ["captions"])
    sys.exit(0 if outcome.ok else 1)
