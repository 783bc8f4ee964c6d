"""The text latents a chunk of `mds_shards` stores (when `text_latents` is configured): looked up
by content_id in the shared `text_latents` table, at the version the attempt pinned, a slice of
rows at a time (a latent of an 8B model is up to 2 MB: a chunk never holds all of its own)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prx_core.shards.mds.encodings import CAPTION_KEY, latent_key, mask_key
from prx_core.store import lance_io
from prx_core.store.lookups import lookup_keys
from prx_core.store.storage import Storage

NO_TEXT_LATENT = "no_text_latent"  # reject reason: the caption has no latent of the configured encoder


def _where(latents: Mapping[str, Any], captioner_version: str) -> str:
    return (f"captioner_version = {lance_io.sql_literal(captioner_version)} AND "
            f"encoder_version = {lance_io.sql_literal(latents['encoder_version'])}")


def latent_tokens(storage: Storage, latents: Mapping[str, Any], captioner_version: str, content_ids: Sequence[str],
                  version: int) -> dict[str, int]:
    """content_id -> caption tokens, for the contents that have a latent (no latent bytes read)."""
    table = lookup_keys(storage.lance_uri("text_latents"), "content_id", content_ids, ["content_id", "tokens"],
                        _where(latents, captioner_version), storage.lance_storage_options(), version)
    return dict(zip(table["content_id"].to_pylist(), table["tokens"].to_pylist()))


def latent_fields(storage: Storage, latents: Mapping[str, Any], captioner_version: str, content_ids: Sequence[str],
                  version: int) -> dict[str, dict[str, np.ndarray]]:
    """content_id -> the sample's latent fields: `latent_caption_<preset>` (bfloat16 bits, uint16
    [rows, hidden]) and, with masks, `attention_mask_caption_<preset>` (uint8 [max_tokens], the
    caption's tokens first: right padding)."""
    table = lookup_keys(storage.lance_uri("text_latents"), "content_id", content_ids,
                        ["content_id", "tokens", "hidden", "latent"], _where(latents, captioner_version),
                        storage.lance_storage_options(), version)
    preset, max_tokens = latents["preset"], latents["max_tokens"]
    out: dict[str, dict[str, np.ndarray]] = {}
    for content_id, tokens, hidden, data in zip(*(table[c].to_pylist() for c in table.column_names)):
        fields = {latent_key(CAPTION_KEY, preset): np.frombuffer(data, np.uint16).reshape(-1, hidden)}
        if latents["masks"]:
            mask = np.zeros(max_tokens, np.uint8)
            mask[:tokens] = 1
            fields[mask_key(CAPTION_KEY, preset)] = mask
        out[content_id] = fields
    return out


def missing_latent_message(latents: Mapping[str, Any]) -> str:
    return (f"no text latent of encoder {latents['preset']}:{latents['encoder_version'][:12]} for this caption: "
            "materialize text_latents for this source (its coverage check lists encoder failures)")
