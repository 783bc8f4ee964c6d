"""Stage `caption_labels`: visual / text / nsfw for every captioned eligible content.

Labels are computed from caption text only, keyed by (content_id, captioner version, labeler
version): a new captioner or a new labeler relabels, a rerun of either reuses. A labeler that can
fail (llm: `error` column) stores no row for a failed caption: it is counted in `failed` /
`failures` (by error code) and labelled again on the next materialization. The llm labeller with
transport `vllm` runs as one `ray.data.llm` stage (prx_core.models.labels_vllm) instead of the actor pool
of `LabelBatch`, into the same upsert. Labels are committed every `commit_every` rows as they
arrive, so hours of GPU labelling are never held in memory or lost to one crash.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.parallel import Progress, quiet_ray_data
from prx_core.models.label_base import LabelerConfig
from prx_core.models.labels import LabelBatch
from prx_core.store import lance_io, maintenance
from prx_core.store.lookups import pending_captions, read_labels
from prx_core.store.storage import Storage

if TYPE_CHECKING:
    import ray.data

LABEL_KEYS = ["content_id", "captioner_version", "labeler_version"]
COMMIT_EVERY = 5000  # labels per commit: a crash loses at most this many


@dataclass
class LabelsReport:
    source: str
    captioned: int  # eligible contents with a caption
    reused: int
    labelled: int
    seconds: float
    distribution: dict[str, int] = field(default_factory=dict)  # over all captioned eligible contents
    labels_version: int | None = None
    failed: int = 0  # of `labelled` (attempted): no label stored, retried next time
    failures: dict[str, int] = field(default_factory=dict)  # error code -> count
    read_versions: dict[str, int] = field(default_factory=dict)
    gpu_hours: float | None = None  # llm over vllm: engine replicas x GPUs each x labelling time


def build_labels(
    source: str, storage: Storage, captioner_version: str, config: LabelerConfig, *, actors: int = 1,
    progress: Progress | None = None, commit_every: int = COMMIT_EVERY,
) -> LabelsReport:
    start = time.monotonic()
    options = storage.lance_storage_options()
    existing = read_labels(storage, captioner_version, config.version())
    captions, todo, versions = pending_captions(source, storage, captioner_version, existing["content_id"])
    report = LabelsReport(source, captions.num_rows, captions.num_rows - todo.num_rows, todo.num_rows, 0.0, read_versions=versions)
    uri = storage.lance_uri("caption_labels")
    if todo.num_rows:
        generation_start = time.monotonic()
        rows = label_rows(label_dataset(todo, config, actors), captioner_version, report, progress)
        report.labels_version = lance_io.upsert_stream(uri, rows, LABEL_KEYS, options, commit_every)
        if config.backend == "llm" and config.transport == "vllm":
            report.gpu_hours = (time.monotonic() - generation_start) * config.replicas * config.tensor_parallel_size / 3600
    if lance_io.table_exists(uri, options):  # new labels get their content_id index (a delta segment)
        report.labels_version = maintenance.refresh_table_indexes(uri, "caption_labels", options).version
    current = read_labels(storage, captioner_version, config.version())
    current = current.filter(pc.is_in(current["content_id"], captions["content_id"]))
    report.distribution = dict(Counter(current["label"].to_pylist()))
    report.seconds = time.monotonic() - start
    return report


def label_dataset(todo: pa.Table, config: LabelerConfig, actors: int) -> ray.data.Dataset:
    """The Ray Data pipeline that labels `todo`: an actor pool of `LabelBatch`, or for the llm
    labeller with transport `vllm` a ray.data.llm stage sized by `replicas`."""
    import ray.data

    quiet_ray_data()
    dataset = ray.data.from_arrow(todo)
    if config.backend == "llm" and config.transport == "vllm":
        from prx_core.models import labels_vllm

        return labels_vllm.label_dataset(dataset, config)
    return dataset.map_batches(
        LabelBatch, fn_constructor_kwargs={"config": config}, compute=ray.data.ActorPoolStrategy(size=actors),
        batch_size=config.batch_size, batch_format="numpy",
    )


def label_rows(dataset: ray.data.Dataset, captioner_version: str, report: LabelsReport,
               progress: Progress | None) -> Iterator[pa.Table]:
    """`caption_labels` rows batch by batch as the labeller produces them; failed rows are
    counted in `report` by error code and not stored, so the next run retries them."""
    done = 0
    failures: Counter[str] = Counter()
    for labelled in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        done += labelled.num_rows
        if "error" in labelled.column_names:
            errors = labelled["error"].cast(pa.string()).fill_null("")
            failed = [e for e in errors.to_pylist() if e]
            report.failed += len(failed)
            failures.update(e.split(":", 1)[0] for e in failed)
            report.failures = dict(failures)
            labelled = labelled.filter(pc.equal(errors, ""))
        if progress is not None:
            progress(done, report.labelled)
        yield pa.table({
            "content_id": labelled["content_id"].cast(pa.string()),
            "captioner_version": pa.array([captioner_version] * labelled.num_rows, pa.string()),
            "labeler_version": labelled["labeler_version"].cast(pa.string()),
            "labeler_id": labelled["labeler_id"].cast(pa.string()),
            "label": labelled["label"].cast(pa.string()),
            "score": labelled["score"].cast(pa.float32()),
        })
