"""Stage `captions`: caption every eligible content of a source once per captioner version.

Eligible means bucketed (not rejected, not dropped): nothing that cannot reach the corpus is
captioned. A model's captions are keyed by (`content_id`, captioner version) and shared by all
sources, so re-ingests, byte-identical images in two sources and reruns after a crash reuse them;
the `source` captioner's are keyed by (content, the sample's own caption), so a sample never
ships another source's text (prx_core.models.caption_keys). Every caption is checked before it is
stored (prx_core.models.caption_checks, prx_core.stages.captions.quality): a refused one is
generated once more with the fallback decoding, then stored `rejected` and refused by mds_shards.
The source runs as work units (prx_core.stages.contents) on captioner actors (one model each);
each unit looks up which of its contents are captioned already, captions the rest and writes
them as fragments, which the driver appends in batched commits. Failures are stored with their
error and retried on the next run (the retry replaces the failed row). The `vllm` backend runs
the same units through one `ray.data.llm` pipeline (prx_core.stages.model_pipeline).

Under the `source` captioner a content whose source has no caption is not a captioner failure:
it is stored the same way (`no_source_caption`, looked at again on the next run), counted apart
(`without_source_caption`, outside `failed`, `failures` and the coverage check's offenders) and
refused by `mds_shards` (`no_caption`). A source of which no eligible content got a caption
fails the run (`NoSourceCaptions`): it needs a VLM captioner, not a retry.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute import wire
from prx_core.compute.actors import ModelHost
from prx_core.compute.parallel import Throttle, chunk, take_rows
from prx_core.compute.units import ModelSpec, Unit, UnitRun
from prx_core.models.caption_base import NO_SOURCE_CAPTION, SOURCE, VLLM, CaptionerConfig
from prx_core.models.caption_checks import REJECTED
from prx_core.models.captioning import CaptionBatch, no_source_captions_message
from prx_core.models.fused import FusedCaptionBatch, check_fusable
from prx_core.models.text_latents import TextLatentsConfig, to_latent_rows
from prx_core.stages.contents import (
    CONTENT_VOLATILE,
    FAILED_EXAMPLES,
    UNIT_ROWS,
    commit_appends,
    model_batches,
    model_seconds,
    model_units,
    offending_samples,
    owned_captions,
    pin_contents,
    prefetched,
    stored_rows,
    write_latents,
)
from prx_core.stages.captions.quality import (
    QUALITY_COLUMNS,
    detail_owners,
    rejected_detail,
    judged_rows,
    new_quality,
    refused_unchecked,
    stored_quality,
)
from prx_core.stages.captions.report import CaptionsReport
from prx_core.stages.model_pipeline import pipeline_units
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage
from prx_core.upkeep.appends import BatchedAppend, keys_predicate

CAPTION_KEYS = ["content_id", "captioner_version"]
ROWS_PER_READ = 64  # rows per take by row address (64 source images of 400 KB: 25 MB), read ahead of the model
TEXT_ROWS_PER_READ = 4096  # the `source` captioner reads no image: 4,096 captions are ~1 MB, one dataset open


class NoSourceCaptions(RuntimeError):
    """Under the `source` captioner, no eligible content of the source has a caption."""


def version_filter(config: CaptionerConfig) -> str:
    return f"captioner_version = {lance_io.sql_literal(config.version())}"


def failed_captions(config: CaptionerConfig, keys: list[str]) -> str:
    """The stored rows of these keys that their new captions replace: failures, and captions stored
    before the checks existed that fail them now (no verdict)."""
    return keys_predicate("content_id", keys, f"{version_filter(config)} AND (error != '' OR verdict IS NULL)")


def pending_captions(unit: Unit, run: UnitRun, *, config: CaptionerConfig) -> tuple[pa.Table, dict[str, Any]]:
    """The unit's owned captions still to make (`owned_captions`: content_id, caption_key,
    sample_id, _rowaddr), and its counts so far: failures and unchecked captions the checks refuse
    now are made again (`retry`: their rows are replaced), the rest is reused with its verdict."""
    owned = owned_captions(run.storage, run.manifest.inputs, run.manifest.partition, unit.spec, config.version())
    keys = owned["caption_key"].to_pylist()
    stored = stored_rows(run.storage, "captions", keys, QUALITY_COLUMNS, version_filter(config))
    unchecked = stored.filter(pc.and_(pc.equal(stored["error"], ""), pc.is_null(stored["verdict"])))["content_id"]
    texts = stored_rows(run.storage, "captions", unchecked.to_pylist(), ["content_id", "caption"],
                        f"{version_filter(config)} AND error = ''")
    refused = set(refused_unchecked(config, texts))
    done = set(stored.filter(pc.equal(stored["error"], ""))["content_id"].to_pylist()) - refused
    todo = owned.filter(pc.invert(pc.is_in(owned["caption_key"], pa.array(sorted(done), pa.string()))))
    replaced = set(stored.filter(pc.not_equal(stored["error"], ""))["content_id"].to_pylist()) | refused
    rejected = stored.filter(pc.equal(pc.fill_null(stored["verdict"], ""), REJECTED))
    return todo, {"rows": unit.rows, "eligible": owned.num_rows, "reused": owned.num_rows - todo.num_rows,
                  "retry": sorted(replaced & set(todo["caption_key"].to_pylist())), "rechecked": len(refused),
                  "quality": stored_quality(stored, done),
                  "rejected_detail": rejected_detail(rejected["content_id"].to_pylist(), rejected["problem"].to_pylist(),
                                                     detail_owners(owned), FAILED_EXAMPLES)}


def read_caption_inputs(storage: Storage, version: int, addresses: list[int], with_image: bool,
                        keys: list[str] | None = None) -> pa.Table:
    """The captioner's input rows (content_id, original_caption, image) by row address; with `keys`,
    `content_id` holds each row's caption key, the column the captions are stored under."""
    columns = ["content_id", "original_caption"] + (["image"] if with_image else [])
    rows = take_rows(storage.lance_uri("samples"), version, addresses, columns, storage.lance_storage_options())
    if keys is not None:
        rows = rows.set_column(0, "content_id", pa.array(keys, pa.string()))
    if not with_image:
        rows = rows.append_column("image", pa.array([b""] * rows.num_rows, pa.large_binary()))
    return rows


def caption_unit(host: ModelHost, unit: Unit, run: UnitRun, *, config: CaptionerConfig) -> dict[str, Any]:
    """On a captioner actor: caption the unit's pending captions, write them as fragments (the
    captioner is loaded only when some are pending)."""
    todo, summary = pending_captions(unit, run, config=config)
    with_image = config.backend != SOURCE
    size = ROWS_PER_READ if with_image else TEXT_ROWS_PER_READ
    loads = [partial(read_caption_inputs, run.storage, run.manifest.inputs["samples"], addresses, with_image, keys)
             for addresses, keys in zip(chunk(todo["_rowaddr"].to_pylist(), size),
                                        chunk(todo["caption_key"].to_pylist(), size))]
    parts, model_seconds = [], 0.0
    for inputs in prefetched(loads):
        outputs, seconds = model_batches(host, inputs, config.batch_size)
        parts += [pa.table(out) for out in outputs]
        model_seconds += seconds
    fused = fused_summary(run.storage, parts, config.version()) if "fused_encoder_version" in run.manifest.params else {}
    written = caption_summary(run.storage, parts, detail_owners(todo))
    quality = Counter(summary.pop("quality")) + Counter(written.pop("quality", {}))
    detail = summary.pop("rejected_detail") + written.pop("rejected_detail", [])
    return {**summary, **written, **fused, "quality": dict(quality), "rejected_detail": detail[:FAILED_EXAMPLES],
            "model_seconds": round(model_seconds, 4)}


def fused_summary(storage: Storage, parts: list[pa.Table], captioner_version: str) -> dict[str, Any]:
    """The latents a fused captioner computed with its captions (none for a failed caption),
    written as `text_latents` fragments."""
    rows = pa.concat_tables([schemas.TEXT_LATENTS.empty_table()] + [
        to_latent_rows(p.filter(pc.is_valid(p["latent"])), captioner_version) for p in parts])
    written = write_latents(storage, rows)
    return {"encoded": written["encoded"], "latent_fragments": written["fragments"]}


def latent_appends(summary: dict[str, Any]) -> dict[str, Any]:
    """A fused unit's summary as the `text_latents` appends read it."""
    return {"fragments": summary.get("latent_fragments") or []}


def read_pipeline_inputs(run: UnitRun, todo: pa.Table, config: CaptionerConfig) -> pa.Table:
    return read_caption_inputs(run.storage, run.manifest.inputs["samples"], todo["_rowaddr"].to_pylist(),
                               config.backend != SOURCE, todo["caption_key"].to_pylist())


def write_captions(storage: Storage, batch: pa.Table, config: CaptionerConfig) -> dict[str, Any]:
    """The vLLM pipeline's rows of one unit, checked (one pass: a refused answer is rejected), written."""
    return caption_summary(storage, [judged_rows(batch, config)])


def caption_summary(storage: Storage, parts: list[pa.Table],
                    owners: dict[str, Any] | None = None) -> dict[str, Any]:
    """Counts of the produced caption rows, and the fragments they were written to; `owners`
    (caption key -> content_id, sample_id) names the samples of the failures (else keys are contents)."""
    if not parts:
        return {"captioned": 0, "failed": 0, "without_source_caption": 0, "fragments": []}
    batch = pa.concat_tables(parts)
    rows = to_caption_rows(batch)
    if owners:  # a source caption's key is not its content: keep the content beside it (offenders, audits)
        images = [None if (o := owners.get(k)) is None or o[0] == k else o[0] for k in rows["content_id"].to_pylist()]
        rows = rows.set_column(rows.schema.get_field_index("image_content_id"), "image_content_id",
                               pa.array(images, pa.string()))
    errors, verdicts = rows["error"].to_pylist(), rows["verdict"].to_pylist()
    words = [w for w, e, v in zip(rows["word_count"].to_pylist(), errors, verdicts) if not e and v != REJECTED]
    owner = (owners or {}).get
    reasons = [(*(owner(c) or (c, "")), e.split(":", 1)[0]) for c, e in zip(rows["content_id"].to_pylist(), errors) if e]
    failed = [(c, r, s) for c, s, r in reasons if r != NO_SOURCE_CAPTION]  # the captioner's own failures
    uncaptioned = [[c, r, s] for c, s, r in reasons if r == NO_SOURCE_CAPTION]
    tokens = int(pc.sum(batch["num_generated_tokens"]).as_py() or 0) if "num_generated_tokens" in batch.column_names else 0
    written = lance_io.write_fragments(storage.lance_uri("captions"), rows, schemas.CAPTIONS,
                                       storage.lance_storage_options())
    return {"captioned": len(errors) - len(reasons), "failed": len(failed), "without_source_caption": len(uncaptioned),
            "failures": dict(Counter(r for _, r, _ in failed)),
            "words": sum(words), "in_100_200_words": sum(100 <= w <= 200 for w in words), "output_tokens": tokens,
            "failed_examples": [c for c, _, _ in failed][:5],
            "failed_detail": [[c, r, s] for c, r, s in failed][:FAILED_EXAMPLES],
            "uncaptioned_detail": uncaptioned[:FAILED_EXAMPLES],
            "rejected_detail": rejected_detail([k for k, v in zip(rows["content_id"].to_pylist(), verdicts) if v == REJECTED],
                                               [p for p, v in zip(rows["problem"].to_pylist(), verdicts) if v == REJECTED],
                                               owners or {}, FAILED_EXAMPLES),
            **new_quality(rows), "fragments": [f.to_json() for f in written]}


def to_caption_rows(batch: pa.Table) -> pa.Table:
    """The CAPTIONS columns of a captioner's output (a column it does not give is null)."""
    return schemas.table_of({name: batch[name] for name in batch.column_names}, schemas.CAPTIONS)


def pin_captions(run: StageRun[CaptionsSettings]) -> dict[str, int]:
    """The pinned versions and units; the captioner's version (and the vLLM path, the fused encoder)
    in the manifest. Fused, the latents recorded units wrote and no commit took are appended first."""
    config = run.settings.config
    run.params["captioner_version"] = config.version()
    lance_io.upgrade_table(run.storage.lance_uri("captions"), schemas.CAPTIONS, run.storage.lance_storage_options())
    if config.backend == VLLM:
        run.params["path"] = "pipeline"
    if run.settings.fused is not None:
        check_fusable(config, run.settings.fused)
        run.params["fused_encoder_version"] = run.settings.fused.version()
        run.state["latents"] = BatchedAppend(run.storage, "text_latents", merge_rows=0)
        recorded = UnitRun.recorded(run.storage, run.stage.name, run.partition)
        run.state["latents"].commit_recorded(latent_appends(s) for s in recorded)
    return pin_contents(run, run.settings.appends or BatchedAppend(run.storage, "captions",
                                                             failed_rows=partial(failed_captions, config)))


def caption_units(run: StageRun[CaptionsSettings]) -> None:
    """Captioner actors, one model each; the `vllm` backend: one ray.data.llm pipeline (`replicas` sizes it)."""
    config = run.settings.config
    if config.backend == VLLM:
        from prx_core.models import captioning_vllm

        pipeline_units(run, prepare=partial(pending_captions, config=config),
                       read=partial(read_pipeline_inputs, config=config), write=partial(write_captions, config=config),
                       pipeline=partial(captioning_vllm.caption_dataset, config=config))
    elif run.settings.fused is not None:  # one model per actor makes captions and their latents
        appends, latents = run.state["appends"], run.state["latents"]

        def on_result(summary: dict[str, Any]) -> None:
            appends.add(summary)
            latents.add(latent_appends(summary))

        run.units("units", run.state["units"], partial(caption_unit, config=config), on_result=on_result,
                  model=ModelSpec(partial(FusedCaptionBatch, config, run.settings.fused), actors=run.settings.actors))
    else:
        model_units(run, partial(caption_unit, config=config),
                    ModelSpec(partial(CaptionBatch, config), actors=run.settings.actors))


def commit_captions(run: StageRun[CaptionsSettings]) -> dict[str, int | None]:
    """The last appends: the captions, and fused, their latents (indexed like any append)."""
    versions = commit_appends(run)
    if run.settings.fused is not None:
        versions["text_latents"] = run.state["latents"].finish()
    return versions


def report_captions(run: StageRun[CaptionsSettings]) -> CaptionsReport:
    """The counts, a few offenders; refuses (`NoSourceCaptions`) a source the `source` captioner found no caption in."""
    config = run.settings.config
    results, source, appends, versions = run.results["units"], run.partition, run.state["appends"], dict(run.inputs)
    vllm = config.backend == VLLM
    report = CaptionsReport(
        source, results.total("eligible"), results.total("reused"), results.total("captioned"), results.total("failed"),
        0.0, failures=results.counts("failures"), words=results.total("words"),
        in_100_200_words=results.total("in_100_200_words"), captions_version=appends.version, read_versions=versions,
        output_tokens=results.total("output_tokens"), generation_seconds=results.seconds,
        model_seconds=model_seconds(results), commits=appends.commits, units=results,
        actors=config.replicas * config.tensor_parallel_size if vllm else run.settings.actors,
        failed_examples=[c for s in results.summaries for c in s.get("failed_examples") or []][:10])
    report.without_source_caption = results.total("without_source_caption")
    report.quality, report.fallbacks = results.counts("quality"), results.total("fallbacks")
    report.rejected_now, report.rechecked = results.total("rejected_now"), results.total("rechecked")
    rejected = [d for s in results.summaries for d in s.get("rejected_detail") or []]
    report.rejected_offenders = offending_samples(run.storage, source, rejected, versions["buckets"])
    report.latents_encoded, report.text_latents_version = results.total("encoded"), run.versions.get("text_latents")
    failed = [d for s in results.summaries for d in s.get("failed_detail") or []]
    report.offenders = offending_samples(run.storage, source, failed, versions["buckets"])
    uncaptioned = [d for s in results.summaries for d in s.get("uncaptioned_detail") or []]
    report.without_source_caption_examples = [row["sample_id"] or row["content_id"] for row in
                                              offending_samples(run.storage, source, uncaptioned, versions["buckets"])]
    if vllm:
        report.gpu_hours = report.generation_seconds * config.replicas * config.tensor_parallel_size / 3600
    report.seconds = run.seconds
    if config.backend == SOURCE and report.eligible and not report.captioned + report.reused:
        raise NoSourceCaptions(no_source_captions_message(source, report.eligible))
    return report


@dataclass(frozen=True, kw_only=True)
class CaptionsSettings(Settings):
    """The `captions` settings: the captioner (it enters the manifest as its version), actors, rows per
    unit, a shared appender (a build's stages batch their appends) and a fused latent encoder."""

    config: CaptionerConfig
    actors: int = 1
    unit_rows: int = UNIT_ROWS
    appends: BatchedAppend | None = None
    fused: TextLatentsConfig | None = None


CAPTIONS: Stage[CaptionsSettings] = Stage(
    "captions", reads=("samples", "buckets"), writes=("captions",), after=("buckets",),
    code_version="2", report_type=CaptionsReport,
    settings=CaptionsSettings,
    unit_sizes=(UnitSize("unit_rows", "Samples per `captions` unit: minutes of GPU work, so a crash loses little."),),
    # the captioner (and a fused encoder) enter as versions; actors and appends shape no output
    unpinned=("config", "actors", "appends", "fused"),
    phases=("units", "prepare"), pin=pin_captions, work=caption_units, commit=commit_captions, report=report_captions,
    volatile=CONTENT_VOLATILE,  # other sources' ingest moves them: a rerun resumes across it
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(CaptionsReport, CaptionerConfig, TextLatentsConfig)
wire.register_moved_from("prx_core.stages.captions_report", CaptionsReport)  # before the captions package


def build_captions(
    source: str, storage: Storage, config: CaptionerConfig, *, actors: int = 1, progress: Throttle | None = None,
    unit_rows: int = UNIT_ROWS, appends: BatchedAppend | None = None, fused: TextLatentsConfig | None = None,
) -> CaptionsReport:
    """`captions` of one source (`run_partition` of CAPTIONS); `appends` replaces the default batched
    appends; `fused` computes the captions' text latents on the captioner's model (transformers)."""
    return run_partition(CAPTIONS, storage, source, progress=progress, config=config, actors=actors,
                         unit_rows=unit_rows, appends=appends, fused=fused)
