"""The classes allowed on the wire (`prx_core.compute.wire`): every dataclass a stage takes or
returns through `prx_core.stages.entry.run_stage`, nested ones included, in one reviewed list.

Nothing else can be built from a Pipes message, whatever a prx_core module happens to import
(`lance.blob.Blob`, ...). tests/core/test_wire.py walks the stages' type hints and fails when a
dataclass they can carry is missing here. `ModelSpec` (a factory function) never crosses.
"""

from __future__ import annotations

from prx_core.compute import wire
from prx_core.compute.unit_results import UnitResults
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.embeddings import EmbedderConfig
from prx_core.models.label_base import LabelerConfig
from prx_core.models.text_latents import TextLatentsConfig
from prx_core.shards.publish import StreamReport
from prx_core.shards.verify import VerifyReport
from prx_core.sources.catalog import DownloadSettings, JoinSpec, SourceSpec
from prx_core.stages import entry
from prx_core.stages.buckets import BucketsReport
from prx_core.stages.caption_embeddings import CaptionEmbeddingsReport
from prx_core.stages.captions import CaptionsReport
from prx_core.stages.duplicates import DuplicatesReport
from prx_core.stages.duplicates_check import KeeperCheck
from prx_core.stages.explorer import ExplorerReport
from prx_core.stages.labels import LabelsReport
from prx_core.stages.mds_shards import MdsReport
from prx_core.stages.phashes import PhashesReport
from prx_core.stages.sample_keys import KeyResolution
from prx_core.stages.samples import SamplesReport
from prx_core.stages.skip_lists import SkipPolicy, SkipReport, StreamSkips
from prx_core.stages.text_latents import TextLatentsReport
from prx_core.store.maintenance import FragmentHealth, IndexReport, VectorIndexCoverage
from prx_core.store.storage import Storage

ARGUMENTS: tuple[type, ...] = (
    SourceSpec, JoinSpec, DownloadSettings, Storage, CaptionerConfig, LabelerConfig, EmbedderConfig, SkipPolicy,
    TextLatentsConfig, entry.Progress,
)
REPORTS: tuple[type, ...] = (
    entry.IngestReport, SamplesReport, UnitResults, KeyResolution, FragmentHealth,
    BucketsReport, PhashesReport,
    entry.GroupsReport, DuplicatesReport, KeeperCheck,
    CaptionsReport, LabelsReport, CaptionEmbeddingsReport, IndexReport, VectorIndexCoverage,
    entry.PublishReport, MdsReport, StreamReport, VerifyReport, entry.StreamCount,
    SkipReport, StreamSkips, TextLatentsReport, ExplorerReport,
)
for _cls in ARGUMENTS + REPORTS:
    wire.register(_cls)


def report_type(stage: str) -> type:
    """The class `stage` reports (its declaration's `report_type`): the only report accepted."""
    if stage not in entry.STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(entry.STAGES)}")
    return entry.STAGES[stage].report_type
