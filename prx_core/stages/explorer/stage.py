"""Stage `explorer`: the explorer's rows of one source, and its facet counts.

The explorer's pages filter on and show columns of seven tables. Joining them in the explorer's
memory costs ~520 B per row in every explorer process (52 GB at 100M rows), rebuilt whenever any
table moves; here each source's rows are joined once, on workers, when what they read changed:
one denormalized `explorer` row per sample and per ingest reject (`schemas.EXPLORER`), with the
caption shown (the captioner version `mds_shards` writes) and the labeler's label, indexed for the
page filters (BITMAP), keys (BTREE) and the text search (INVERTED). The filter menus' counts are
summed from the units into `explorer_facets`, a few hundred rows per source, so the explorer's
home page reads no corpus-sized table at all.

Units are ranges of the source's content ids in the pinned `samples` partition (phase `samples`,
planned as the content stages plan theirs) and row ranges of its ingest rejects (phase `rejects`:
rows that never reached `samples`); each looks its keys up in the pinned versions of the other
tables (BTREE on sample_id or content_id). A range of content ids keeps a unit's keys in the
content-keyed tables (`captions`, `caption_labels`) adjacent, so those lookups read the few index
pages of the range whatever the tables' sizes; its per-sample lookups stay within the source's
contiguous part of each sample_id index (docs/scale.md). A rerun commits nothing (`reusable`) when
what it reads of its source did not change, whatever other sources did: the table versions are
`volatile` (every source's commits move them) and the reuse key is `source_reads`, per table a
digest of this source's part (`read_signatures`), plus the skip-list files and the settings.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.compute.key_ranges import plan_partition_ranges, range_predicate
from prx_core.compute.row_units import plan_row_units, read_row_unit
from prx_core.compute.units import Unit, UnitResults, UnitRun
from prx_core.shards.skiplists.files import source_folder
from prx_core.stages.explorer.rows import (
    REJECT_COLUMNS,
    SAMPLE_COLUMNS,
    count_facets,
    explore_rows,
    facet_rows,
    sample_base,
)
from prx_core.stages.report import StageReport
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.stages.unchanged import last_commit
from prx_core.store import lance_io, schemas
from prx_core.store.lookups import lookup_keys, lookup_where
from prx_core.store.partitions import commit_partition, rejects_predicate, source_predicate, unit_outputs, write_partition
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_table

UNIT_ROWS = 250_000  # sizes only: each unit looks its keys up in seven tables, 5,000 keys per query
UNIT_RULE = "content-ranges"  # how `samples` units are cut, in the manifest
JOINED = ("rejects", "buckets", "phashes", "duplicates", "captions", "caption_labels", "mds_index")
PER_SOURCE = ("samples", "rejects", "buckets", "phashes", "mds_index")  # tables with a `source` partition
GROUP_COLUMNS = ["sample_id", "group_id", "group_size", "keeper", "keeper_sample_id"]
INGEST = "samples"  # the stage name of ingest rejects: rows that never reached `samples`


@dataclass
class ExplorerReport(StageReport):
    WRITTEN = {"explorer": "explorer_version", "explorer_facets": "facets_version"}

    source: str
    rows: int  # explorer rows written: samples plus ingest rejects
    samples: int
    ingest_rejects: int
    captioned: int
    in_mds: int
    skipped: int
    facets: int  # explorer_facets rows
    seconds: float
    explorer_version: int = 0
    facets_version: int = 0
    read_versions: dict[str, int] | None = None  # the pinned inputs (tables written so far)
    units: dict[str, UnitResults] | None = None


def _summary(storage: Storage, rows: pa.Table) -> dict[str, Any]:
    written = lance_io.write_fragments(storage.lance_uri("explorer"), rows, schemas.EXPLORER,
                                       storage.lance_storage_options()) if rows.num_rows else []
    rejected = sum(v == "rejected" for v in rows["caption_verdict"].to_pylist())
    return {"rows": rows.num_rows, "captioned": rows.num_rows - rows["caption"].null_count - rejected,
            "in_mds": rows.num_rows - rows["mds_index"].null_count,
            "skipped": rows.num_rows - rows["skip_reason"].null_count,
            "facets": count_facets(rows), **unit_outputs(storage, "explorer", written, [])}


def explore_samples_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: the explorer rows of one range of the source's content ids (a range read of the
    `samples` BTREE), as an uncommitted fragment."""
    storage, inputs = run.storage, run.manifest.inputs
    uri = storage.lance_uri("samples")
    has_metadata = "metadata" in lance_io.require_table(uri, storage.lance_storage_options()).schema.names
    where = f"{source_predicate(run.manifest.partition)} AND {range_predicate('content_id', unit.spec)}"
    read = lookup_where(uri, SAMPLE_COLUMNS + (["metadata"] if has_metadata else []), where,
                        storage.lance_storage_options(), inputs["samples"])
    rows = explore_rows(storage, inputs, sample_base(read), run.manifest.params)
    return {"samples": rows.num_rows, **_summary(storage, rows)}


def explore_rejects_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: the explorer rows of one range of ingest rejects whose id has no `samples` row."""
    storage, inputs, source = run.storage, run.manifest.inputs, run.manifest.partition
    refused = read_row_unit(storage.lance_uri("rejects"), inputs["rejects"], unit.spec, REJECT_COLUMNS,
                            rejects_predicate(source, INGEST), storage.lance_storage_options())
    ids = sorted(set(refused["sample_id"].to_pylist()))
    stored = lookup_keys(storage.lance_uri("samples"), "sample_id", ids, ["sample_id"], None,
                         storage.lance_storage_options(), inputs["samples"]) if inputs.get("samples") else None
    if stored is not None and stored.num_rows:
        refused = refused.filter(pc.invert(pc.is_in(refused["sample_id"], stored["sample_id"])))
    first = {sid: i for i, sid in reversed(list(enumerate(refused["sample_id"].to_pylist())))}
    refused = refused.take(sorted(first.values()))  # one row per id: a file refused twice is one row
    n = refused.num_rows
    base = pa.table({**{c: refused[c] for c in ("sample_id", "content_id", "source", "source_key", "width", "height")},
                     "format": pa.nulls(n, pa.string()), "jpeg_quality": pa.nulls(n, pa.int16()),
                     "num_bytes": pa.nulls(n, pa.int64()), "original_caption": pa.nulls(n, pa.string()),
                     "stored": pa.array([False] * n, pa.bool_()), "meta_label": pa.nulls(n, pa.string())})
    rows = explore_rows(storage, inputs, base, run.manifest.params)
    return {"ingest_rejects": n, **_summary(storage, rows)}


def skip_fingerprint(storage: Storage, source: str) -> str:
    """A digest of the source's skip-list files (names and sizes): they change without a table version."""
    fs = storage.filesystem()
    folder = source_folder(storage.root, source)
    fs.invalidate_cache()
    files = fs.find(folder, detail=True) if fs.exists(folder) else {}
    listing = sorted((path[len(folder):], info.get("size")) for path, info in files.items())
    return hashlib.sha256(repr(listing).encode()).hexdigest()[:24]


def groups_digest(storage: Storage, source: str, version: int | None = None) -> str | None:
    """A digest of the source's rows in duplicate groups (what the explorer shows and the skip-lists
    drop): it changes when another source's copy joins one of this source's groups, and only then."""
    uri, options = storage.lance_uri("duplicates"), storage.lance_storage_options()
    if lance_io.open_table(uri, options) is None:
        return None
    return lance_io.partition_digest(uri, f"{source_predicate(source)} AND group_size >= 2", GROUP_COLUMNS,
                                     options, version)


def read_signatures(storage: Storage, source: str, versions: dict[str, int | None]) -> dict[str, str | None]:
    """Per table, a digest of what the explorer reads of `source` at `versions`: the fragments of the
    source's partition (`partition_signature`), its duplicate groups, and, for the content-keyed
    `captions` and `caption_labels`, the source's own last run of those stages (`last_commit`): another
    source's captions move the table but not what this source shows."""
    options = storage.lance_storage_options()
    reads: dict[str, str | None] = {
        t: lance_io.partition_signature(storage.lance_uri(t), source_predicate(source), options, versions[t])
        for t in PER_SOURCE if versions[t] is not None}
    reads["duplicates"] = groups_digest(storage, source, versions["duplicates"]) if versions["duplicates"] else None
    for stage in ("captions", "caption_labels"):
        reads[stage] = last_commit(storage, stage, source)
    return reads


def pin_tables(run: StageRun[ExplorerSettings]) -> dict[str, Any]:
    """The pinned versions of every table the rows join (None: not written yet), the units planned."""
    storage, options, source = run.storage, run.storage.lance_storage_options(), run.partition
    if not lance_io.table_exists(storage.lance_uri("samples"), options):
        raise RuntimeError("the samples table does not exist yet: materialize `samples` first")
    lance_io.upgrade_table(storage.lance_uri("explorer"), schemas.EXPLORER, options)  # workers write its schema
    samples, run.state["samples"] = plan_partition_ranges(storage.lance_uri("samples"), "content_id",
                                                          source_predicate(source), run.settings.unit_rows, options)
    run.params["units"] = UNIT_RULE  # attempts of the earlier rule (row ranges) start over
    inputs: dict[str, int | None] = {"samples": samples}
    for table in JOINED:
        inputs[table] = lance_io.table_version(storage.lance_uri(table), options)
    run.state["rejects"] = []
    if inputs["rejects"] is not None:
        _, run.state["rejects"] = plan_row_units(storage.lance_uri("rejects"), rejects_predicate(source, INGEST),
                                                 run.settings.unit_rows, options, version=inputs["rejects"])
    run.params["skip_lists"] = skip_fingerprint(storage, source)
    return {**inputs, "source_reads": read_signatures(storage, source, inputs)}


def explore_units(run: StageRun[ExplorerSettings]) -> None:
    run.units("samples", [Unit(f"samples-{u.id}", u.rows, u.spec) for u in run.state["samples"]], explore_samples_unit)
    run.units("rejects", [Unit(f"rejects-{u.id}", u.rows, u.spec) for u in run.state["rejects"]], explore_rejects_unit)


def summed_facets(results: list[UnitResults]) -> dict[str, Counter[str]]:
    counts: dict[str, Counter[str]] = {}
    for summary in (s for r in results for s in r.summaries):
        for facet, values in summary["facets"].items():
            counts.setdefault(facet, Counter()).update(values)
    return counts


def commit_explorer(run: StageRun[ExplorerSettings]) -> dict[str, int]:
    """The partition's explorer rows replaced in one commit (indexed on a worker), then its facets."""
    results = [run.results[p] for p in run.stage.phases]
    fragments = lance_io.fragments_from_json(f for r in results for s in r.summaries for f in s["fragments"])
    explorer = commit_partition(run.storage, "explorer", source_predicate(run.partition), fragments, index_table)
    facets = facet_rows(run.partition, summed_facets(results))
    run.state["facets"] = facets.num_rows
    return {"explorer": explorer,
            "explorer_facets": write_partition(run.storage, "explorer_facets", source_predicate(run.partition), facets)}


def report_explorer(run: StageRun[ExplorerSettings]) -> ExplorerReport:
    results = {p: run.results[p] for p in run.stage.phases}

    def total(key: str) -> int:
        return sum(r.total(key) for r in results.values())

    return ExplorerReport(source=run.partition, rows=total("rows"), samples=total("samples"),
                          ingest_rejects=total("ingest_rejects"), captioned=total("captioned"), in_mds=total("in_mds"),
                          skipped=total("skipped"), facets=run.state["facets"], seconds=run.seconds,
                          explorer_version=run.versions["explorer"], facets_version=run.versions["explorer_facets"],
                          read_versions={t: v for t, v in run.inputs.items() if isinstance(v, int)}, units=results)


@dataclass(frozen=True, kw_only=True)
class ExplorerSettings(Settings):
    """The `explorer` settings: whose captions and labels it shows, and rows per unit."""

    captioner_version: str
    labeler_version: str
    unit_rows: int = UNIT_ROWS


EXPLORER: Stage[ExplorerSettings] = Stage(
    # 2: search_text; 3: captions by caption key, what produced them, their verdicts, the worst captions
    "explorer", reads=("samples", *JOINED), writes=("explorer", "explorer_facets"), code_version="4",
    after=("samples", "buckets", "phashes", "captions", "caption_labels", "mds_shards", "duplicates", "skip_lists"),
    report_type=ExplorerReport, phases=("samples", "rejects"),
    settings=ExplorerSettings,
    unit_sizes=(UnitSize("unit_rows", "Samples per `explorer` unit, a range of content ids (and ingest rejects "
                                      "per unit of its rejects)."),),
    pin=pin_tables, work=explore_units, commit=commit_explorer, report=report_explorer,
    reusable=lambda report: True, volatile=("samples", *JOINED),
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(ExplorerReport)
# its name before this module moved into the explorer package: a reused run's report is recorded under it
wire.register_moved_from("prx_core.stages.explorer", ExplorerReport)


def build_explorer(source: str, storage: Storage, progress: Throttle | None = None, **settings: Any) -> ExplorerReport:
    """`explorer` of one source (`run_partition` of EXPLORER): captioner_version, labeler_version, unit_rows."""
    return run_partition(EXPLORER, storage, source, progress=progress, **settings)
