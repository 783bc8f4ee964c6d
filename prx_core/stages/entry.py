"""The stages by name, and `run_stage`: what an asset runs, in its own process or as a Ray job.

`STAGES` holds every stage's declaration (`prx_core.stages.stage.Stage`); `run_stage(name, kwargs,
log)` runs one through `run_partition`, the call both paths make. In the Dagster process the
asset calls it directly; on a cluster with a job server, `python -m prx_core.stages.job` calls
it inside a Ray job (long runs outlive Ray Client connections) and sends the report back through
Dagster Pipes. Arguments and reports are `prx_core` dataclasses and plain values, so they cross
as JSON (`prx_core.compute.wire`); a `Progress` argument becomes progress lines in `log`.
Three stages report more than their own run, a step of their one declaration (`then`): the ingest
settles repeated sample ids, `mds_shards` reads its streams back, `duplicates` checks its keepers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.stages.buckets import BUCKETS
from prx_core.stages.caption_embeddings import CAPTION_EMBEDDINGS
from prx_core.stages.captions.stage import CAPTIONS
from prx_core.stages.duplicates.stage import DUPLICATES, GroupsReport
from prx_core.stages.explorer.stage import EXPLORER
from prx_core.stages.labels import CAPTION_LABELS
from prx_core.stages.mds_shards.report import PublishReport, StreamCount
from prx_core.stages.mds_shards.stage import MDS_SHARDS
from prx_core.stages.phashes import PHASHES
from prx_core.stages.samples.stage import SAMPLES, IngestReport
from prx_core.stages.skip_lists.stage import SKIP_LISTS
from prx_core.stages.stage import Stage, run_partition
from prx_core.stages.text_latents import TEXT_LATENTS

# the reports of the three stages with a `then` step, where the assets have always imported them from
__all__ = ["STAGES", "GroupsReport", "IngestReport", "Progress", "PublishReport", "StreamCount", "report_type",
           "run_stage"]


@dataclass(frozen=True)
class Progress:
    """Progress lines `label: done/total unit, rate, ETA` in the caller's log (a `Throttle`)."""

    label: str
    unit: str = "units"


STAGES: dict[str, Stage] = {stage.name: stage for stage in (SAMPLES, BUCKETS, PHASHES, MDS_SHARDS, SKIP_LISTS,
                                                             DUPLICATES, CAPTIONS, CAPTION_LABELS, CAPTION_EMBEDDINGS,
                                                             TEXT_LATENTS, EXPLORER)}
# what this module adds on the wire (each stage module registers what its stage takes and reports)
WIRE_TYPES = wire.register_all(Progress)


def report_type(name: str) -> type:
    """The class stage `name` reports (its declaration's `report_type`): the only report accepted."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return STAGES[name].report_type


def run_stage(name: str, kwargs: dict[str, Any], log: Callable[[str], None]) -> Any:
    """Run stage `name` with `kwargs` (storage, source, settings); every `Progress` among them
    reports through `log`."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    bound = {k: Throttle(log, v.label, unit=v.unit) if isinstance(v, Progress) else v for k, v in kwargs.items()}
    return run_partition(STAGES[name], **bound)
