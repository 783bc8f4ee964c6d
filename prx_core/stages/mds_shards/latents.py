"""The text latents a chunk of `mds_shards` stores (when `text_latents` is configured): found by
the route units in the shared `text_latents` table (prx_core.stages.mds_shards.carried), taken by
row address at the version the attempt pinned, a slice of rows at a time (a latent of an 8B model
is up to 2 MB: a chunk never holds all of its own)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prx_core.compute.parallel import take_rows
from prx_core.shards.mds.encodings import CAPTION_KEY, latent_key, mask_key
from prx_core.store import lance_io
from prx_core.store.storage import Storage

NO_TEXT_LATENT = "no_text_latent"  # reject reason: the caption has no latent of the configured encoder


def latent_where(latents: Mapping[str, Any], captioner_version: str) -> str:
    """The `text_latents` rows of the configured encoder for this captioner's captions."""
    return (f"captioner_version = {lance_io.sql_literal(captioner_version)} AND "
            f"encoder_version = {lance_io.sql_literal(latents['encoder_version'])}")


def latent_fields(storage: Storage, latents: Mapping[str, Any], version: int,
                  addresses: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """The samples' latent fields, from their rows' addresses in `text_latents` at the pinned
    version (the route units found them): `latent_caption_<preset>` (bfloat16 bits, uint16
    [rows, hidden]) and, with masks, `attention_mask_caption_<preset>` (uint8 [max_tokens], the
    caption's tokens first: right padding)."""
    table = take_rows(storage.lance_uri("text_latents"), version, list(addresses), ["tokens", "hidden", "latent"],
                      storage.lance_storage_options())
    preset, max_tokens = latents["preset"], latents["max_tokens"]
    out: list[dict[str, np.ndarray]] = []
    for tokens, hidden, data in zip(*(table[c].to_pylist() for c in table.column_names)):
        fields = {latent_key(CAPTION_KEY, preset): np.frombuffer(data, np.uint16).reshape(-1, hidden)}
        if latents["masks"]:
            mask = np.zeros(max_tokens, np.uint8)
            mask[:tokens] = 1
            fields[mask_key(CAPTION_KEY, preset)] = mask
        out.append(fields)
    return out


def missing_latent_message(latents: Mapping[str, Any]) -> str:
    return (f"no text latent of encoder {latents['preset']}:{latents['encoder_version'][:12]} for this caption: "
            "materialize text_latents for this source (its coverage check lists encoder failures)")
