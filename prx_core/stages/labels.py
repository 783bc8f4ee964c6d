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

import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.actors import ModelHost
from prx_core.compute.parallel import Throttle
from prx_core.compute.units import ModelSpec, Unit, UnitResults, UnitRun
from prx_core.models.label_base import LabelerConfig
from prx_core.models.labels import LabelBatch
from prx_core.stages.contents import (
    FAILED_EXAMPLES,
    UNIT_ROWS,
    captioned_pending,
    model_batches,
    offending_samples,
    run_content_stage,
)
from prx_core.stages.model_pipeline import run_pipeline_stage
from prx_core.store import lance_io, schemas
from prx_core.upkeep.appends import BatchedAppend
from prx_core.store.locks import exclusive
from prx_core.store.storage import Storage

LABEL_KEYS = ["content_id", "captioner_version", "labeler_version"]


@dataclass
class LabelsReport:
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


@exclusive("caption_labels")
def build_labels(
    source: str, storage: Storage, captioner_version: str, config: LabelerConfig, *, actors: int = 1,
    progress: Throttle | None = None, unit_rows: int = UNIT_ROWS, appends: BatchedAppend | None = None,
    model: ModelSpec | None = None,
) -> LabelsReport:
    """`model` replaces the configured labeller's actors (a stand-in of the same output, in benchmarks)."""
    start = time.monotonic()
    appends = appends or BatchedAppend(storage, "caption_labels")
    params = {"captioner_version": captioner_version, "labeler_version": config.version(), "batch_size": config.batch_size}
    code_version = f"{config.version()}-{captioner_version}"
    vllm = config.backend == "llm" and config.transport == "vllm"
    if vllm:  # one ray.data.llm pipeline over the units; `replicas` sizes it
        from prx_core.models import labels_vllm

        results, versions = run_pipeline_stage(
            storage, source, "caption_labels", code_version, params, prepare=pending_labels,
            read=lambda run, todo: todo, write=partial(write_labels, captioner_version=captioner_version),
            pipeline=partial(labels_vllm.label_dataset, config=config), appends=appends, progress=progress,
            unit_rows=unit_rows)
    else:
        model = model or ModelSpec(partial(LabelBatch, config), actors=actors)
        results, versions, _ = run_content_stage(storage, source, "caption_labels", code_version, params, label_unit,
                                                 model, progress=progress, unit_rows=unit_rows, appends=appends)
    versions["captions"] = lance_io.table_version(storage.lance_uri("captions"), storage.lance_storage_options())
    report = LabelsReport(source, results.total("captioned"), results.total("reused"), results.total("labelled"), 0.0,
                          distribution=results.counts("distribution"), labels_version=appends.version,
                          failed=results.total("failed"), failures=results.counts("failures"), read_versions=versions,
                          commits=appends.commits, units=results,
                          offenders=offending_samples(storage, source, [d for s in results.summaries
                                                                       for d in s.get("failed_detail") or []],
                                                      versions["buckets"]))
    if vllm:
        report.gpu_hours = results.seconds * config.replicas * config.tensor_parallel_size / 3600
    report.seconds = time.monotonic() - start
    return report
