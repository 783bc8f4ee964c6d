"""The work of a `captions` unit: which of its captions are still to make (failures and captions
the checks now refuse are made again, the rest reused with its verdict), their inputs read ahead of
the model, the captions checked (prx_core.stages.captions.quality) and written as fragments, with
the counts the stage reports; on a captioner actor (`caption_unit`), or as the three steps of the
vLLM pipeline (prx_core.stages.model_pipeline: prepare, read, write). Fused, a unit writes the
captions' text latents too."""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.actors import ModelHost
from prx_core.compute.parallel import chunk, take_rows
from prx_core.compute.units import Unit, UnitRun
from prx_core.models.caption_base import NO_SOURCE_CAPTION, SOURCE, CaptionerConfig
from prx_core.models.caption_checks import REJECTED
from prx_core.models.text_latents import to_latent_rows
from prx_core.stages.captions.quality import (
    QUALITY_COLUMNS,
    detail_owners,
    judged_rows,
    new_quality,
    refused_unchecked,
    rejected_detail,
    retryable,
    stored_quality,
)
from prx_core.stages.contents import FAILED_EXAMPLES, model_batches, owned_captions, prefetched, stored_rows, write_latents
from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage
from prx_core.upkeep.appends import keys_predicate

CAPTION_KEYS = ["content_id", "captioner_version"]
ROWS_PER_READ = 64  # rows per take by row address (64 source images of 400 KB: 25 MB), read ahead of the model
TEXT_ROWS_PER_READ = 4096  # the `source` captioner reads no image: 4,096 captions are ~1 MB, one dataset open


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
    """The vLLM pipeline's first answers of one unit, checked and written; the refused ones are
    held back for the fallback pass (`held`: their caption key, problem and tokens)."""
    rows = judged_rows(batch, config)
    held = retryable(rows, config)
    kept = rows.filter(pc.invert(held))
    refused = rows.filter(held).select(["content_id", "problem", "num_generated_tokens"])
    return {**caption_summary(storage, [kept] if kept.num_rows else []),
            "held": refused.rename_columns(["content_id", "first_problem", "first_tokens"])}


def write_retried(storage: Storage, batch: pa.Table, config: CaptionerConfig) -> dict[str, Any]:
    """The fallback decoding's answers of one unit, checked as second attempts (a refusal is final), written."""
    return caption_summary(storage, [judged_rows(batch, config, attempts=2)])


def read_refused(run: UnitRun, todo: pa.Table, refused: pa.Table, config: CaptionerConfig) -> pa.Table:
    """The fallback pass's input rows: the refused captions' inputs, with their first attempt."""
    rows = read_pipeline_inputs(run, todo.filter(pc.is_in(todo["caption_key"], refused["content_id"])), config)
    first = refused.take(pc.index_in(rows["content_id"], refused["content_id"]))  # in the rows' order
    return rows.append_column("first_problem", first["first_problem"]).append_column(
        "first_tokens", pc.cast(first["first_tokens"], pa.int64()))


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
