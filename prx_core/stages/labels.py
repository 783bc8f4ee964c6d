"""Stage `caption_labels`: visual / text / nsfw for every captioned eligible content.

Labels are computed from caption text only, keyed by (content_id, captioner version, labeler
version): a new captioner or a new labeler relabels, a rerun of either reuses. The source runs
as work units (prx_core.stages.contents) on labeller actors: each unit looks up its contents'
captions and stored labels by content_id, labels the rest and writes fragments, appended in
batched commits. A labeler that can fail (llm: `error` column) stores no row for a failed
caption: it is counted in `failed` / `failures` (by error code) and labelled again on the next
materialization. The llm labeller with transport `vllm` runs the same units through one
`ray.data.llm` pipeline (prx_core.stages.model_pipeline).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute import wire
from prx_core.compute.actors import ModelHost
from prx_core.compute.parallel import Throttle
from prx_core.compute.units import ModelSpec, Unit, UnitResults, UnitRun
from prx_core.models.label_base import LabelerConfig
from prx_core.models.labels import LabelBatch
from prx_core.stages.contents import (
    CONTENT_VOLATILE,
    FAILED_EXAMPLES,
    UNIT_ROWS,
    captioned_pending,
    commit_appends,
    model_batches,
    model_seconds,
    model_units,
    offending_samples,
    pin_contents,
)
from prx_core.stages.model_pipeline import pipeline_units
from prx_core.stages.report import StageReport
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage
from prx_core.upkeep.appends import BatchedAppend

LABEL_KEYS = ["content_id", "captioner_version", "labeler_version"]


@dataclass
class LabelsReport(StageReport):
    ROWS = "captioned"
    WRITTEN = {"caption_labels": "labels_version"}

    source: str
    captioned: int  # eligible contents with a caption
    reused: int
    labelled: int  # attempted by this run
    seconds: float
    distribution: dict[str, int] = field(default_factory=dict)  # over all captioned eligible contents
    labels_version: int | None = None
    failed: int = 0  # of `labelled` (attempted): no label stored, retried next time
    failures: dict[str, int] = field(default_factory=dict)  # error code -> count
    offenders: list[dict[str, str]] = field(default_factory=list)  # sample_id, content_id, reason of a few failures
    read_versions: dict[str, int] = field(default_factory=dict)
    gpu_hours: float | None = None  # llm over vllm: engine replicas x GPUs each x labelling time
    commits: int = 0
    units: UnitResults | None = None
    model_seconds: float = 0.0  # time the labellers spent inside the model, summed over actors


def pending_labels(unit: Unit, run: UnitRun) -> tuple[pa.Table, dict[str, Any]]:
    """The unit's captioned contents without a label (content_id, caption), and its counts so far."""
    captions, stored, todo = captioned_pending(unit, run, "caption_labels", "labeler_version", ["content_id", "label"])
    return todo, {"rows": unit.rows, "captioned": captions.num_rows, "reused": captions.num_rows - todo.num_rows,
                  "labelled": todo.num_rows, "distribution": dict(Counter(stored["label"].to_pylist()))}


def label_unit(host: ModelHost, unit: Unit, run: UnitRun) -> dict[str, Any]:
    """On a labeller actor: label the unit's pending captions, write them as fragments."""
    todo, summary = pending_labels(unit, run)
    outputs, model_seconds = model_batches(host, todo, run.manifest.params["batch_size"])
    parts = [pa.table(out) for out in outputs]
    written = write_labels(run.storage, pa.concat_tables(parts), run.manifest.params["captioner_version"]) if parts else {}
    distribution = Counter(summary.pop("distribution")) + Counter(written.pop("distribution", {}))
    return {**summary, **written, "distribution": dict(distribution), "model_seconds": round(model_seconds, 4)}


def write_labels(storage: Storage, labelled: pa.Table, captioner_version: str) -> dict[str, Any]:
    """`caption_labels` fragments of the successful labels; failures are counted, not stored."""
    failures: Counter[str] = Counter()
    detail: list[list[str]] = []
    if "error" in labelled.column_names:
        errors = labelled["error"].cast(pa.string()).fill_null("")
        failures.update(e.split(":", 1)[0] for e in errors.to_pylist() if e)
        detail = [[str(c), e.split(":", 1)[0]] for c, e in zip(labelled["content_id"].to_pylist(), errors.to_pylist())
                  if e][:FAILED_EXAMPLES]
        labelled = labelled.filter(pc.equal(errors, ""))
    rows = pa.table({
        "content_id": labelled["content_id"].cast(pa.string()),
        "captioner_version": pa.array([captioner_version] * labelled.num_rows, pa.string()),
        "labeler_version": labelled["labeler_version"].cast(pa.string()),
        "labeler_id": labelled["labeler_id"].cast(pa.string()),
        "label": labelled["label"].cast(pa.string()),
        "score": labelled["score"].cast(pa.float32()),
    }, schema=schemas.CAPTION_LABELS)
    written = lance_io.write_fragments(storage.lance_uri("caption_labels"), rows, schemas.CAPTION_LABELS,
                                       storage.lance_storage_options()) if rows.num_rows else []
    return {"failed": sum(failures.values()), "failures": dict(failures), "failed_detail": detail,
            "fragments": [f.to_json() for f in written], "distribution": dict(Counter(rows["label"].to_pylist()))}


def uses_vllm(config: LabelerConfig) -> bool:
    return config.backend == "llm" and config.transport == "vllm"


def pin_labels(run: StageRun[LabelsSettings]) -> dict[str, int]:
    """The pinned versions and units; the labeller's version and batch size (and the vLLM path) in the manifest."""
    config = run.settings.config
    run.params.update(labeler_version=config.version(), batch_size=config.batch_size)
    if uses_vllm(config):
        run.params["path"] = "pipeline"
    return pin_contents(run, run.settings.appends or BatchedAppend(run.storage, "caption_labels"),
                        follows=("captions",))


def label_units(run: StageRun[LabelsSettings]) -> None:
    """Labeller actors (or `model`, a stand-in of the same output); llm over vllm: one ray.data.llm pipeline."""
    config = run.settings.config
    if uses_vllm(config):  # `replicas` sizes it
        from prx_core.models import labels_vllm

        pipeline_units(run, prepare=pending_labels, read=read_pending,
                       write=partial(write_labels, captioner_version=run.settings.captioner_version),
                       pipeline=partial(labels_vllm.label_dataset, config=config))
    else:
        settings = run.settings
        model_units(run, label_unit, settings.model or ModelSpec(partial(LabelBatch, config), actors=settings.actors))


def read_pending(run: UnitRun, todo: pa.Table) -> pa.Table:
    return todo  # the pending rows (content_id, caption) are the pipeline's input


def report_labels(run: StageRun[LabelsSettings]) -> LabelsReport:
    config = run.settings.config
    results, source, appends = run.results["units"], run.partition, run.state["appends"]
    versions = {**run.inputs, "captions": lance_io.table_version(run.storage.lance_uri("captions"),
                                                                  run.storage.lance_storage_options())}
    failed = [d for s in results.summaries for d in s.get("failed_detail") or []]
    report = LabelsReport(source, results.total("captioned"), results.total("reused"), results.total("labelled"), 0.0,
                          distribution=results.counts("distribution"), labels_version=appends.version,
                          failed=results.total("failed"), failures=results.counts("failures"), read_versions=versions,
                          commits=appends.commits, units=results, model_seconds=model_seconds(results),
                          offenders=offending_samples(run.storage, source, failed, versions["buckets"]))
    if uses_vllm(config):
        report.gpu_hours = results.seconds * config.replicas * config.tensor_parallel_size / 3600
    report.seconds = run.seconds
    return report


@dataclass(frozen=True, kw_only=True)
class LabelsSettings(Settings):
    """The `caption_labels` settings: whose captions, the labeller (it enters as its version), actors,
    rows per unit, a shared appender, and an in-process model (tests)."""

    captioner_version: str
    config: LabelerConfig
    actors: int = 1
    unit_rows: int = UNIT_ROWS
    appends: BatchedAppend | None = None
    model: ModelSpec | None = None


CAPTION_LABELS: Stage[LabelsSettings] = Stage(
    "caption_labels", reads=("samples", "buckets", "captions"), writes=("caption_labels",), after=("captions",),
    code_version="1",
    report_type=LabelsReport,
    settings=LabelsSettings,
    unit_sizes=(UnitSize("unit_rows", "Samples per `caption_labels` unit: minutes of model work, so a crash "
                                      "loses little."),),
    unpinned=("config", "actors", "appends", "model"),  # the labeller enters as its version and batch size
    phases=("units", "prepare"), pin=pin_labels, work=label_units, commit=commit_appends, report=report_labels,
    volatile=CONTENT_VOLATILE,  # other sources' ingest moves them: a rerun resumes across it
    reusable=lambda report: report.failed == 0,  # failed labels are retried by the next run
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(LabelsReport, LabelerConfig)


def build_labels(
    source: str, storage: Storage, captioner_version: str, config: LabelerConfig, *, actors: int = 1,
    progress: Throttle | None = None, unit_rows: int = UNIT_ROWS, appends: BatchedAppend | None = None,
    model: ModelSpec | None = None,
) -> LabelsReport:
    """`caption_labels` of one source (`run_partition` of CAPTION_LABELS). `model` replaces the
    configured labeller's actors (a stand-in of the same output, in benchmarks; in-process only)."""
    return run_partition(CAPTION_LABELS, storage, source, progress=progress, captioner_version=captioner_version,
                         config=config, actors=actors, unit_rows=unit_rows, appends=appends, model=model)
