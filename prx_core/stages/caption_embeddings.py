"""Stage `caption_embeddings`: vectors for the explorer's nearest-neighbour search.

Two tables, each with a cosine vector index `embedding_vector` on `embedding`:
- `caption_embeddings`: MiniLM vectors of captions, keyed by (content_id, captioner version,
  embedder version) and shared by sources like `caption_labels`. The source runs as work units
  (prx_core.stages.contents) on embedder actors (one model each): a unit looks up its contents'
  captions and stored vectors by content_id, embeds the rest and writes fragments, appended in
  batched commits. A new captioner or embedder re-embeds, a rerun reuses and commits nothing.
- `source_embeddings`: the source's own vectors, replaced per source (prx_core.stages.source_embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from prx_core.compute import wire
from prx_core.compute.actors import ModelHost
from prx_core.compute.parallel import Throttle, run_on_worker
from prx_core.compute.units import ModelSpec, Unit, UnitResults, UnitRun
from prx_core.models.embeddings import EmbedBatch, EmbedderConfig
from prx_core.stages.contents import (
    CONTENT_VOLATILE,
    UNIT_ROWS,
    captioned_pending,
    commit_appends,
    model_batches,
    model_seconds,
    model_units,
    pin_contents,
)
from prx_core.stages.report import StageReport
from prx_core.stages.source_embeddings import fixed_size_vectors, write_source_embeddings
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.maintenance import IndexReport, VectorIndexCoverage
from prx_core.store.storage import Storage
from prx_core.upkeep.appends import BatchedAppend
from prx_core.upkeep.indexing import index_table

EMBEDDING_KEYS = ["content_id", "captioner_version", "embedder_version"]
VECTOR_COLUMN = "embedding"
TABLES = ("caption_embeddings", "source_embeddings")


@dataclass
class CaptionEmbeddingsReport(StageReport):
    ROWS = "captioned"
    WRITTEN = {"caption_embeddings": "caption_embeddings_version", "source_embeddings": "source_embeddings_version"}

    source: str
    captioned: int  # eligible contents with a caption
    reused: int  # of those, already embedded for (captioner, embedder)
    embedded: int
    seconds: float = 0.0
    embedding_seconds: float = 0.0  # wall time of the Ray pipeline (actor start and model load included)
    covered: int = 0  # captioned eligible contents with an embedding after the run
    source_rows: int = 0  # rows of the source in `source_embeddings` after the run
    skipped: int = 0  # samples whose source vector is null, empty, of another length or not finite
    source_dim: int | None = None  # the most common length of the source's vectors
    dim_mismatch: str | None = None  # why nothing was written for the source
    source_written: bool = False  # False when the partition was already identical (or mismatched)
    caption_embeddings_version: int | None = None
    source_embeddings_version: int | None = None
    read_versions: dict[str, int] = field(default_factory=dict)
    indexes: dict[str, IndexReport] = field(default_factory=dict)
    coverage: dict[str, VectorIndexCoverage] = field(default_factory=dict)
    commits: int = 0
    units: UnitResults | None = None
    model_seconds: float = 0.0  # time the embedders spent inside the model, summed over actors

    @property
    def embeddings_per_second(self) -> float:
        return self.embedded / max(self.embedding_seconds, 1e-9)


def pending_embeddings(unit: Unit, run: UnitRun) -> tuple[pa.Table, dict[str, Any]]:
    """The unit's captioned contents without a vector (content_id, caption), and its counts."""
    captions, _, todo = captioned_pending(unit, run, "caption_embeddings", "embedder_version")
    return todo, {"rows": unit.rows, "captioned": captions.num_rows, "reused": captions.num_rows - todo.num_rows}


def embed_unit(host: ModelHost, unit: Unit, run: UnitRun) -> dict[str, Any]:
    """On an embedder actor: embed the unit's pending captions, write them as fragments."""
    todo, summary = pending_embeddings(unit, run)
    params = run.manifest.params
    outputs, model_seconds = model_batches(host, todo, params["batch_size"])
    parts = [to_embedding_rows(out, params["captioner_version"], params["dim"]) for out in outputs]
    written = lance_io.write_fragments(run.storage.lance_uri("caption_embeddings"), pa.concat_tables(parts),
                                       schemas.CAPTION_EMBEDDINGS, run.storage.lance_storage_options()) if parts else []
    return {**summary, "embedded": todo.num_rows, "fragments": [f.to_json() for f in written],
            "model_seconds": round(model_seconds, 4)}


def pin_embeddings(run: StageRun[EmbeddingsSettings]) -> dict[str, int]:
    """The pinned versions and units; the embedder's version, batch size and width in the manifest."""
    config = run.settings.config
    run.params.update(embedder_version=config.version(), batch_size=config.batch_size, dim=config.dim)
    appends = BatchedAppend(run.storage, "caption_embeddings", refresh_indexes=False)  # indexed below
    return pin_contents(run, appends, follows=("captions",))


def embed_units(run: StageRun[EmbeddingsSettings]) -> None:
    """Embedder actors, one model each (or `model`, a stand-in of the same output)."""
    settings = run.settings
    model = settings.model or ModelSpec(partial(EmbedBatch, settings.config), actors=settings.actors)
    model_units(run, embed_unit, model)


def commit_embeddings(run: StageRun[EmbeddingsSettings]) -> dict[str, int | None]:
    """The last append; then the source's own vectors (SOURCE_EMBEDDINGS, on the `samples` version
    the units read) and both vector indexes caught up on a worker (IVF training grows with rows)."""
    commit_appends(run)
    run.state["captions"] = lance_io.table_version(run.storage.lance_uri("captions"),  # newest, as units read it
                                                   run.storage.lance_storage_options())
    run.state["source"] = write_source_embeddings(run.partition, run.storage, run.inputs["samples"], run.progress)
    run.state["indexes"] = run_on_worker(index_tables, run.storage)
    options = run.storage.lance_storage_options()
    return {table: lance_io.table_version(run.storage.lance_uri(table), options) for table in TABLES}


def report_embeddings(run: StageRun[EmbeddingsSettings]) -> CaptionEmbeddingsReport:
    results, written = run.results["units"], run.state["source"]
    report = CaptionEmbeddingsReport(run.partition, results.total("captioned"), results.total("reused"),
                                     results.total("embedded"), embedding_seconds=results.seconds,
                                     read_versions={**run.inputs, "captions": run.state["captions"]},
                                     commits=run.state["appends"].commits, units=results,
                                     model_seconds=model_seconds(results))
    report.covered = report.reused + report.embedded  # a vector cannot fail: an error fails the unit
    report.source_rows, report.skipped, report.source_dim = written.rows, written.skipped, written.dim
    report.dim_mismatch, report.source_written = written.mismatch, written.written
    report.indexes, report.coverage = run.state["indexes"]
    report.caption_embeddings_version = run.versions["caption_embeddings"]
    report.source_embeddings_version = run.versions["source_embeddings"]
    report.seconds = run.seconds
    return report


@dataclass(frozen=True, kw_only=True)
class EmbeddingsSettings(Settings):
    """The `caption_embeddings` settings: whose captions, the embedder (it enters as its version),
    actors, rows per unit and an in-process model (tests)."""

    captioner_version: str
    config: EmbedderConfig
    actors: int = 1
    unit_rows: int = UNIT_ROWS
    model: ModelSpec | None = None


CAPTION_EMBEDDINGS: Stage[EmbeddingsSettings] = Stage(
    "caption_embeddings", reads=("samples", "buckets", "captions"), writes=TABLES, after=("captions", "samples"),
    code_version="1",
    report_type=CaptionEmbeddingsReport,
    settings=EmbeddingsSettings,
    unit_sizes=(UnitSize("unit_rows", "Samples per `caption_embeddings` unit: minutes of model work, so a crash "
                                      "loses little."),),
    unpinned=("config", "actors", "model"),  # the embedder enters as its version, batch size and width
    pin=pin_embeddings, work=embed_units, commit=commit_embeddings, report=report_embeddings,
    volatile=CONTENT_VOLATILE,  # other sources' ingest moves them: a rerun resumes across it
    reusable=lambda report: True,
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(CaptionEmbeddingsReport, EmbedderConfig, IndexReport, VectorIndexCoverage)


def build_caption_embeddings(
    source: str, storage: Storage, captioner_version: str, config: EmbedderConfig, *, actors: int = 1,
    progress: Throttle | None = None, unit_rows: int = UNIT_ROWS, model: ModelSpec | None = None,
) -> CaptionEmbeddingsReport:
    """Embed what is missing, refresh the source's vectors, then catch both vector indexes up
    (`run_partition` of CAPTION_EMBEDDINGS). `model` replaces the embedder's actors (a stand-in
    of the same output, in benchmarks; in-process only)."""
    return run_partition(CAPTION_EMBEDDINGS, storage, source, progress=progress, captioner_version=captioner_version,
                         config=config, actors=actors, unit_rows=unit_rows, model=model)


def index_tables(storage: Storage) -> tuple[dict[str, IndexReport], dict[str, VectorIndexCoverage]]:
    """Catch both tables' indexes up with the new rows; how much of each the vector index covers."""
    options = storage.lance_storage_options()
    indexes, coverage = {}, {}
    for table in TABLES:
        uri = storage.lance_uri(table)
        if lance_io.table_exists(uri, options):
            indexes[table] = index_table(uri, table, options)
            coverage[table] = maintenance.vector_index_coverage(uri, VECTOR_COLUMN, options)
    return indexes, coverage


def to_embedding_rows(batch: dict[str, np.ndarray], captioner_version: str, dim: int) -> pa.Table:
    vectors = np.ascontiguousarray(np.asarray(batch["embedding"], dtype=np.float32).reshape(-1, dim))
    n = len(vectors)
    return pa.table({
        "content_id": pa.array([str(c) for c in batch["content_id"]], pa.string()),
        "captioner_version": pa.array([captioner_version] * n, pa.string()),
        "embedder_version": pa.array([str(v) for v in batch["embedder_version"]], pa.string()),
        "embedder_id": pa.array([str(v) for v in batch["embedder_id"]], pa.string()),
        "embedding": fixed_size_vectors(vectors),
    }, schema=schemas.CAPTION_EMBEDDINGS)
