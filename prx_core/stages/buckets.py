"""Stage `buckets`: tier and (width, height) of every sample, a pure function of its size.

No pixels are read: the upright size recorded at ingest decides. Dropped samples (below the
384² floor, aspect ratio outside [0.5, 2]) also go to `rejects` so every loss has a reason.
Row-range units of the pinned `samples` version run on Ray workers, which write `buckets` and
`rejects` fragments; the driver replaces the partition of each table in one commit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.compute.row_units import plan_row_units, read_row_unit
from prx_core.compute.units import Unit, UnitResults, UnitRun
from prx_core.image.buckets import TIERS, Drop, assign_buckets
from prx_core.stages.report import StageReport
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import commit_unit_outputs, source_predicate, unit_outputs, write_rejects
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_table

UNIT_ROWS = 1_000_000  # sizes only: a unit of a million rows takes seconds and writes one fragment
COLUMNS = ["sample_id", "source", "source_key", "content_id", "width", "height"]


@dataclass
class BucketsReport(StageReport):
    READ = {"samples": "samples_version"}
    WRITTEN = {"buckets": "buckets_version"}

    source: str
    rows: int
    bucketed: int
    dropped: dict[str, int]
    histogram: dict[str, int] = field(default_factory=dict)  # "<tier>/<w>x<h>" -> count
    samples_version: int = 0
    buckets_version: int = 0
    units: UnitResults | None = None


def bucket_samples(samples: pa.Table, max_tier: int = TIERS[-1]) -> tuple[pa.Table, pa.Table]:
    """BUCKETS rows for `samples` (sample_id, source, source_key, content_id, width, height), and
    the REJECTS rows of the dropped ones; columnar, so a unit of a million rows stays cheap."""
    decisions = assign_buckets(samples["width"].to_numpy(), samples["height"].to_numpy(), max_tier)
    kept = [d if not isinstance(d, Drop) else None for d in decisions]
    dropped = [d if isinstance(d, Drop) else None for d in decisions]
    buckets = pa.table({
        **{c: samples[c] for c in ("sample_id", "source", "content_id", "width", "height")},
        "tier": pa.array([b and b.tier for b in kept], pa.int32()),
        "bucket_width": pa.array([b and b.width for b in kept], pa.int32()),
        "bucket_height": pa.array([b and b.height for b in kept], pa.int32()),
        "bucket": pa.array([b and b.name for b in kept], pa.string()),
        "drop_reason": pa.array([d and d.reason for d in dropped], pa.string()),
    }, schema=schemas.BUCKETS)
    mask = pa.array([d is not None for d in dropped], pa.bool_())
    refused = samples.filter(mask)
    reasons = [d for d in dropped if d is not None]
    rejects = pa.table({
        **{c: refused[c] for c in ("sample_id", "source", "source_key", "content_id")},
        "stage": pa.array(["buckets"] * refused.num_rows, pa.string()),
        "reason": pa.array([d.reason for d in reasons], pa.string()),
        "message": pa.array([d.message for d in reasons], pa.string()),
        "width": refused["width"], "height": refused["height"],
    }, schema=schemas.REJECTS)
    return buckets, rejects


def bucket_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: bucket one row range; write its `buckets` and `rejects` fragments (no commit)."""
    storage, source = run.storage, run.manifest.partition
    options = storage.lance_storage_options()
    rows = read_row_unit(storage.lance_uri("samples"), run.manifest.inputs["samples"], unit.spec, COLUMNS,
                         source_predicate(source), options)
    buckets, rejects = bucket_samples(rows, BucketsSettings.from_params(run.manifest.params).max_tier)
    written = lance_io.write_fragments(storage.lance_uri("buckets"), buckets, schemas.BUCKETS, options)
    refused = write_rejects(storage, rejects)
    placed = [f"{t}/{b}" for t, b in zip(buckets["tier"].to_pylist(), buckets["bucket"].to_pylist()) if t is not None]
    return {
        "rows": buckets.num_rows, "bucketed": len(placed), "histogram": dict(Counter(placed)),
        "dropped": dict(Counter(rejects["reason"].to_pylist())),
        **unit_outputs(storage, "buckets", written, refused),
    }


def pin_samples(run: StageRun[BucketsSettings]) -> dict[str, int | str | None]:
    """The `samples` version the units read, planned into row ranges of the partition, and the
    partition's fragments (`source_part`): other sources' ingest moves the version (volatile), and a
    rerun resumes across it while the source's own rows are the same fragments."""
    options = run.storage.lance_storage_options()
    samples_uri = run.storage.lance_uri("samples")
    if not lance_io.table_exists(samples_uri, options):
        raise RuntimeError("the samples table does not exist yet: materialize `samples` first")
    version, run.state["units"] = plan_row_units(samples_uri, source_predicate(run.partition),
                                                 run.settings.unit_rows, options)
    return {"samples": version, "source_part": lance_io.partition_signature(  # `samples` is volatile: this pins
        run.storage.lance_uri("samples"), source_predicate(run.partition), run.storage.lance_storage_options(), version)}


def bucket_units(run: StageRun[BucketsSettings]) -> None:
    run.units("units", run.state["units"], bucket_unit)


def commit_buckets(run: StageRun[BucketsSettings]) -> dict[str, int]:
    version, _ = commit_unit_outputs(run.storage, "buckets", run.partition, "buckets", run.results["units"].summaries,
                                     index=index_table)
    return {"buckets": version}


def report_buckets(run: StageRun[BucketsSettings]) -> BucketsReport:
    results = run.results["units"]
    return BucketsReport(source=run.partition, rows=results.total("rows"), bucketed=results.total("bucketed"),
                         dropped=results.counts("dropped"), histogram=results.counts("histogram"),
                         samples_version=run.inputs["samples"], buckets_version=run.versions["buckets"], units=results)


@dataclass(frozen=True, kw_only=True)
class BucketsSettings(Settings):
    """The `buckets` settings: the largest tier a sample is bucketed into, and rows per unit."""

    max_tier: int = TIERS[-1]
    unit_rows: int = UNIT_ROWS


BUCKETS: Stage[BucketsSettings] = Stage(
    "buckets", reads=("samples",), writes=("buckets", "rejects"), after=("samples",),
    code_version="1", report_type=BucketsReport,
    settings=BucketsSettings,
    unit_sizes=(UnitSize("unit_rows", "Rows per `buckets` unit (sizes only)."),),
    pin=pin_samples, work=bucket_units, commit=commit_buckets, report=report_buckets,
    volatile=("samples",),  # moved by other sources' ingest: `source_part` pins this source's rows
    reusable=lambda report: True,  # a rerun over the same rows of the source runs nothing
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(BucketsReport)


def build_buckets(source: str, storage: Storage, progress: Throttle | None = None, **settings: Any) -> BucketsReport:
    """`buckets` of one source (`run_partition` of BUCKETS): settings max_tier, unit_rows."""
    return run_partition(BUCKETS, storage, source, progress=progress, **settings)
