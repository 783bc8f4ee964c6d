"""The chunks of `mds_shards`: one Ray task per chunk of a stream gathers its routed rows, which
carry their captions (found by caption key in the route units: the content, or under the `source`
captioner the sample's own caption, prx_core.models.caption_keys; a caption the checks rejected
is refused) and where their latents are, decodes and encodes each image once (`process_image`,
without the pHash and quality ingest stored) and writes the chunk folder
(`prx_core.shards.mds.streams`), named after everything its bytes depend on, so a rerun over the
same content reuses the complete folder instead of rewriting it. A chunk looks nothing up by key."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from prx_core.compute.parallel import take_rows
from prx_core.compute.units import Unit, UnitRun
from prx_core.image.decode import Rejection
from prx_core.image.imaging import process_image
from prx_core.models.captioning import missing_caption_message, rejected_caption_message
from prx_core.shards.mds.encodings import latent_columns
from prx_core.shards.mds.streams import MDS_COLUMNS, chunk_complete, read_chunk_record, stream_uri, write_chunk
from prx_core.stages.mds_shards.carried import CARRIED_FIELDS
from prx_core.stages.mds_shards.latents import NO_TEXT_LATENT, latent_fields, missing_latent_message
from prx_core.store.storage import join_uri

TAKE_ROWS = 32  # images read from Lance per request
NO_CAPTION = "no_caption"
CAPTION_REJECTED = "caption_rejected"  # the caption checks refused the captioner's answer twice
BUCKET_MISMATCH = "bucket_mismatch"
CHUNK_FORMAT = "mds-chunk-1"  # bump when what a chunk's bytes depend on changes outside its inputs
ROUTE_SCHEMA = pa.schema([
    ("tier", pa.int32()), ("bucket_width", pa.int32()), ("bucket_height", pa.int32()), ("sample_id", pa.string()),
    ("content_id", pa.string()), ("source_key", pa.string()), ("address", pa.uint64()),  # in `samples`
    *CARRIED_FIELDS])  # what `route` writes


def chunk_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: write one chunk folder of a stream, or reuse the complete folder of the same
    content (a rerun, a resumed run, another run whose inputs hold the same rows), and report what
    it holds."""
    storage, source = run.storage, run.manifest.partition
    tier, width, height = unit.spec["stream"]
    rows = chunk_rows(unit, run)
    originals = rows["original_caption"].to_pylist()
    keys = rows["caption_key"].to_pylist()
    captions = {k: c for k, c in zip(keys, rows["caption"].to_pylist()) if c is not None}
    latents = run.manifest.params.get("latents")
    tokens = ({k: t for k, t in zip(keys, rows["latent_tokens"].to_pylist()) if t is not None} if latents
              else None)
    name = chunk_name(run, rows, captions, originals, tokens)
    folder = join_uri(stream_uri(storage.root, source, tier, width, height), name)
    reused = chunk_complete(folder, storage.storage_options)
    if not reused:
        refused: list[dict] = []
        columns = MDS_COLUMNS | latent_columns(latents["preset"], latents["masks"]) if latents else MDS_COLUMNS
        write_chunk(render(rows, captions, originals, run, refused), folder, storage.storage_options, refused,
                    columns=columns)
    record = read_chunk_record(folder, storage.storage_options)
    stored = record.filter(pc.field("reason").is_null())
    return {"rows": stored.num_rows, "rejected": record.num_rows - stored.num_rows, "reused": int(reused), "name": name,
            "reasons": dict(Counter(record["reason"].drop_null().to_pylist())),
            "outputs": [] if reused else [folder]}  # a reused folder may be live: never an orphan


def chunk_name(run: UnitRun, rows: pa.Table, captions: dict[str, str], originals: list[str | None],
               tokens: dict[str, int] | None = None) -> str:
    """A name derived from everything the chunk's bytes depend on (the code and its settings, each
    row's id, content and captions, its caption key where it is not the content (the record holds
    it), and with text latents the encoder and which captions have one):
    the same content always gets the same folder, other content never does, so a published name is
    never rewritten with other bytes."""
    params = run.manifest.params
    header = [CHUNK_FORMAT, run.manifest.code_version, params["max_tier"], params["max_pixels"]]
    if params.get("latents"):  # only then: chunks written before latents existed keep their names
        header.append(params["latents"])
    digest = hashlib.sha256(json.dumps([*header,
                                        run.manifest.partition, rows["tier"][0].as_py() if rows.num_rows else None,
                                        rows["bucket_width"][0].as_py() if rows.num_rows else None,
                                        rows["bucket_height"][0].as_py() if rows.num_rows else None],
                                       sort_keys=True).encode())
    for sid, cid, key, original, ck in zip(rows["sample_id"].to_pylist(), rows["content_id"].to_pylist(),
                                           rows["source_key"].to_pylist(), originals, rows["caption_key"].to_pylist()):
        row = [sid, cid, key, captions.get(ck), original] + ([ck] if ck != cid else [])  # model captions: as before
        digest.update(json.dumps(row if tokens is None else [*row, tokens.get(ck)]).encode())
    return "c-" + digest.hexdigest()[:24]


def chunk_rows(unit: Unit, run: UnitRun) -> pa.Table:
    """The chunk's routed rows, gathered from every route file (row groups pruned by their
    statistics: route files are sorted the same way), sorted by sample_id."""
    tier, width, height = unit.spec["stream"]
    fs = run.storage.filesystem()
    folder = run.scratch_uri("route")
    paths = sorted(p for p in fs.ls(folder, detail=False) if p.endswith(".parquet"))
    condition = (pc.field("tier") == tier) & (pc.field("bucket_width") == width) & (pc.field("bucket_height") == height)
    if unit.spec["lo"] is not None:
        condition &= pc.field("sample_id") >= unit.spec["lo"]
    if unit.spec["hi"] is not None:
        condition &= pc.field("sample_id") < unit.spec["hi"]
    dataset = pads.dataset(paths, schema=ROUTE_SCHEMA, format="parquet", filesystem=fs)
    return dataset.to_table(filter=condition).sort_by("sample_id")


def render(rows: pa.Table, captions: dict[str, str], originals: list[str | None], run: UnitRun,
           refused: list[dict]) -> Iterator[dict[str, Any]]:
    """The chunk's MDS rows in order, its captions joined by caption key, each image decoded and
    encoded once; what cannot be stored goes to `refused` with a reason (an uncaptioned one with its
    stored failure, a rejected caption with the check that refused it)."""
    storage, params, source = run.storage, run.manifest.params, run.manifest.partition
    latents = params.get("latents")
    for start in range(0, rows.num_rows, TAKE_ROWS):
        part = rows.slice(start, TAKE_ROWS).to_pylist()
        images = take_rows(storage.lance_uri("samples"), run.manifest.inputs["samples"], [r["address"] for r in part],
                           ["image"], storage.lance_storage_options())["image"].to_pylist()
        with_latent = [r for r in part if r["latent_address"] is not None] if latents else []
        extra = dict(zip((r["caption_key"] for r in with_latent), latent_fields(
            storage, latents, run.manifest.inputs["text_latents"], [r["latent_address"] for r in with_latent]))) \
            if with_latent else {}
        for row, image, original in zip(part, images, originals[start:start + TAKE_ROWS]):
            base = {"sample_id": row["sample_id"], "content_id": row["content_id"], "source_key": row["source_key"],
                    "caption_key": row["caption_key"]}
            caption = captions.get(row["caption_key"])
            if caption is None:
                error, problem = row["caption_error"] or "", row["caption_problem"] or ""
                message = (rejected_caption_message(params["captioner_version"], problem) if problem
                           else missing_caption_message(params["captioner_version"], error or None))
                refused.append({**base, "reason": CAPTION_REJECTED if problem else NO_CAPTION, "message": message})
                continue
            if latents and row["caption_key"] not in extra:
                refused.append({**base, "reason": NO_TEXT_LATENT, "message": missing_latent_message(latents)})
                continue
            result = process_image(image, max_pixels=params["max_pixels"], max_tier=params["max_tier"], facts=False)
            if isinstance(result, Rejection):
                refused.append({**base, "reason": result.reason, "message": result.message})
                continue
            got = (result.bucket.tier, result.bucket.width, result.bucket.height)
            if got != (row["tier"], row["bucket_width"], row["bucket_height"]):
                refused.append({**base, "reason": BUCKET_MISMATCH, "message": f"{result.bucket} != routed {got}"})
                continue
            yield {**base, "source": source, "jpeg": result.jpeg, "caption": caption,
                   "original_caption": original or "", "width": result.bucket.width,
                   "height": result.bucket.height, "original_width": result.original_size[0],
                   "original_height": result.original_size[1], **extra.get(row["caption_key"], {})}
