"""Stage `captions`: caption every eligible content of a source once per captioner version.

Eligible means bucketed (not rejected, not dropped): nothing that cannot reach the corpus is
captioned. Captions are keyed by (`content_id`, captioner version) and shared by all sources,
so re-ingests, byte-identical images in two sources and reruns after a crash reuse them;
results are committed every `commit_every` captions so a crash loses at most one batch of work.
Failures are stored with their error and retried on the next run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.parallel import Progress, chunk, quiet_ray_data, take_rows
from prx_core.models.caption_base import VLLM, CaptionerConfig
from prx_core.models.captioning import CaptionBatch
from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.lookups import eligible_contents
from prx_core.store.storage import Storage

if TYPE_CHECKING:
    import ray.data

CAPTION_KEYS = ["content_id", "captioner_version"]
ROWS_PER_READ = 64


@dataclass
class CaptionsReport:
    source: str
    eligible: int  # distinct contents
    reused: int
    captioned: int
    failed: int
    seconds: float
    failures: dict[str, int] = field(default_factory=dict)
    word_counts: list[int] = field(default_factory=list)
    captions_version: int | None = None
    read_versions: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0  # generated tokens, where the backend reports them
    generation_seconds: float = 0.0  # wall time of the captioning pipeline itself
    gpu_hours: float | None = None  # vllm: engine replicas x GPUs each x generation time

    @property
    def images_per_second(self) -> float:
        return (self.captioned + self.failed) / max(self.seconds, 1e-9)

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / max(self.generation_seconds, 1e-9)


def existing_keys(uri: str, version_column: str, version: str, options: dict[str, str], extra: str = "") -> set[str]:
    """content_ids already done for one model version (failed rows excluded when `extra` says so)."""
    dataset = lance_io.open_table(uri, options)
    if dataset is None:
        return set()
    where = f"{version_column} = {lance_io.sql_literal(version)}" + (f" AND {extra}" if extra else "")
    return set(dataset.to_table(columns=["content_id"], filter=where)["content_id"].to_pylist())


def read_caption_inputs(task: dict[str, Any]) -> pa.Table:
    columns = ["content_id", "original_caption"] + (["image"] if task["with_image"] else [])
    rows = take_rows(task["uri"], task["version"], task["addresses"], columns, task["lance_options"])
    if not task["with_image"]:
        rows = rows.append_column("image", pa.array([b""] * rows.num_rows, pa.large_binary()))
    return rows


def build_captions(
    source: str, storage: Storage, config: CaptionerConfig, *, actors: int = 1, commit_every: int = 1000,
    progress: Progress | None = None,
) -> CaptionsReport:
    import ray.data

    start = time.monotonic()
    options = storage.lance_storage_options()
    captions_uri = storage.lance_uri("captions")
    eligible, versions = eligible_contents(source, storage)
    done = existing_keys(captions_uri, "captioner_version", config.version(), options, "error = ''")
    todo = eligible.filter(pc.invert(pc.is_in(eligible["content_id"], pa.array(sorted(done), pa.string()))))
    report = CaptionsReport(source, eligible.num_rows, eligible.num_rows - todo.num_rows, 0, 0, 0.0, read_versions=versions)
    if todo.num_rows:
        base = {"uri": storage.lance_uri("samples"), "version": versions["samples"], "lance_options": options,
                "with_image": config.backend != "source"}
        tasks = [{**base, "addresses": part} for part in chunk(todo["_rowaddr"].to_pylist(), ROWS_PER_READ)]
        quiet_ray_data()
        dataset = ray.data.from_items(tasks, override_num_blocks=len(tasks)).map_batches(
            lambda b: read_caption_inputs(b.to_pylist()[0]), batch_size=1, batch_format="pyarrow")
        if config.backend == VLLM:  # a whole ray.data.llm stage; `config.replicas` sizes it, not `actors`
            from prx_core.models import captioning_vllm

            dataset = captioning_vllm.caption_dataset(dataset, config)
        else:
            dataset = dataset.map_batches(
                CaptionBatch, fn_constructor_kwargs={"config": config}, compute=ray.data.ActorPoolStrategy(size=actors),
                batch_size=config.batch_size, batch_format="numpy")
        generation_start = time.monotonic()
        rows = caption_rows(dataset, report, todo.num_rows, progress)
        lance_io.upsert_stream(captions_uri, rows, CAPTION_KEYS, options, commit_every)
        report.generation_seconds = time.monotonic() - generation_start
        if config.backend == VLLM:
            report.gpu_hours = report.generation_seconds * config.replicas * config.tensor_parallel_size / 3600
        report.captions_version = maintenance.refresh_table_indexes(captions_uri, "captions", options).version
    report.captions_version = report.captions_version or lance_io.table_version(captions_uri, options)
    report.seconds = time.monotonic() - start
    return report


def caption_rows(dataset: ray.data.Dataset, report: CaptionsReport, total: int,
                 progress: Progress | None) -> Iterator[pa.Table]:
    """`captions` rows batch by batch as the captioner produces them, counted into `report`."""
    failures: Counter[str] = Counter()
    for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        table = to_caption_rows(batch)
        if "num_generated_tokens" in batch.column_names:
            report.output_tokens += int(pc.sum(batch["num_generated_tokens"]).as_py() or 0)
        errors = table["error"].to_pylist()
        failures.update(e.split(":", 1)[0] for e in errors if e)
        report.failures = dict(failures)
        report.failed += sum(1 for e in errors if e)
        report.captioned += sum(1 for e in errors if not e)
        report.word_counts += [w for w, e in zip(table["word_count"].to_pylist(), errors) if not e]
        if progress is not None:
            progress(report.captioned + report.failed, total)
        yield table


def to_caption_rows(batch: pa.Table) -> pa.Table:
    return pa.table({name: batch[name].cast(schemas.CAPTIONS.field(name).type) for name in schemas.CAPTIONS.names})
