"""What a route unit of `mds_shards` carries to the chunks beside ids and buckets: each row's
caption key, its source caption, its shipped caption (or the stored failure or check that keeps it
from shipping) and, with text latents, where its latent row is.

Why here and not in the chunks: a chunk holds rows of one stream, so its contents are random
over the key space, and a lookup of 50,000 random keys touches nearly every page of the shared
tables' `content_id` BTREEs (all of them at PRX scale, once per chunk: docs/scale.md). A route unit
owns a range of content ids (prx_core.compute.key_ranges), so its keys (content ids, or `source`
caption keys, which start with their content id) sit on the few index pages of that range
whatever the tables' sizes; the chunks then look up nothing, and take a latent by its address.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.models.caption_keys import caption_keys
from prx_core.stages.mds_shards.latents import latent_where
from prx_core.store.lookups import caption_gaps, lookup_keys, shipped_captions
from prx_core.store.storage import Storage

CARRIED_FIELDS = [
    pa.field("caption_key", pa.string()),  # prx_core.models.caption_keys
    pa.field("original_caption", pa.string()),  # the source's own caption, as ingested
    pa.field("caption", pa.string()),  # the shipped caption; null when it cannot ship
    pa.field("caption_error", pa.string()),  # ... then its stored failure ("" when none is stored)
    pa.field("caption_problem", pa.string()),  # ... or the check that rejected it
    pa.field("latent_tokens", pa.int32()),  # with text latents: the caption's tokens; null without a latent
    pa.field("latent_address", pa.uint64()),  # ... and its row in `text_latents` at the pinned version
]


def carried_columns(storage: Storage, params: Mapping[str, Any], inputs: Mapping[str, Any],
                    content_ids: Sequence[str], originals: Sequence[str | None]) -> dict[str, pa.Array]:
    """The CARRIED_FIELDS columns of these rows (in their order), from one lookup per shared table
    of the unit's keys at the versions the attempt pinned."""
    captioner = params["captioner_version"]
    keys = caption_keys(captioner, content_ids, originals)
    key_array = pa.array(keys, pa.string())
    shipped = shipped_captions(storage, captioner, keys, inputs["captions"])
    caption = shipped["caption"].take(pc.index_in(key_array, shipped["content_id"]))
    missing = pc.is_null(caption)
    gaps = caption_gaps(storage, captioner, key_array.filter(missing).to_pylist(), inputs["captions"])
    why = [gaps.get(k, ("", "")) if gone else None for k, gone in zip(keys, missing.to_pylist())]
    columns = {"caption_key": key_array, "original_caption": pa.array(originals, pa.string()),
               "caption": caption,
               "caption_error": pa.array([w and w[0] for w in why], pa.string()),
               "caption_problem": pa.array([w and w[1] for w in why], pa.string())}
    latents = params.get("latents")
    if latents:
        found = lookup_keys(storage.lance_uri("text_latents"), "content_id", keys, ["content_id", "tokens"],
                            latent_where(latents, captioner), storage.lance_storage_options(), inputs["text_latents"],
                            with_row_address=True)
        at = pc.index_in(key_array, found["content_id"])
        columns["latent_tokens"] = found["tokens"].take(at).cast(pa.int32())
        columns["latent_address"] = found["_rowaddr"].take(at)
    else:
        columns["latent_tokens"] = pa.nulls(len(keys), pa.int32())
        columns["latent_address"] = pa.nulls(len(keys), pa.uint64())
    return {f.name: _array(columns[f.name]) for f in CARRIED_FIELDS}


def _array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
