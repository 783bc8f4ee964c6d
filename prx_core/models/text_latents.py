"""Text latents as PRX's text tower computes them: the caption cleaned, tokenized to `max_tokens`
(padded, truncated, with an attention mask), through the text backbone of a Hugging Face
checkpoint loaded in bfloat16, its last hidden state kept in bfloat16.

Any checkpoint with a language model works; for a VLM (Qwen-VL family) the vision tower is never
run, so the captioner's own checkpoint serves (PRX's `qwen3vl-8b-256-bf16` preset). torch is
imported only where latents are computed; the config is read by drivers and Dagster too.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from prx_core.models.caption_base import fingerprint_checkpoint
from prx_core.store import schemas

DEFAULT_MAX_TOKENS = 256  # PRX's prompt_max_tokens
CLEANINGS = ("basic", "none")
LATENT_FORMAT = "last_hidden_state-bf16-right-padded-1"  # bump when what a stored latent means changes
PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # part of an MDS column name


@dataclass(frozen=True)
class TextLatentsConfig:
    """What decides a latent: the checkpoint (by content), the preset's name (the MDS column's),
    `max_tokens`, whether masks are kept (then a latent holds only the caption's tokens and PRX's
    loader pads it from the mask; without, all `max_tokens` rows) and the cleaning. Batch size and
    device decide speed only, so they stay out of `version()`."""

    model: str
    preset: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    masks: bool = True
    cleaning: str = "basic"
    batch_size: int = 16
    device: str | None = None  # None: cuda when present, else cpu

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"text_latents.model {self.model!r} is not a local Hugging Face checkpoint "
                             "(no config.json): give the checkpoint directory")
        if not PRESET_NAME.fullmatch(self.preset):
            raise ValueError(f"text_latents.preset {self.preset!r} must be 1-64 letters, digits, '.', '_' or '-' "
                             "(it names the MDS columns, e.g. qwen3vl-8b-256-bf16)")
        if not 1 <= self.max_tokens <= 8192:
            raise ValueError(f"text_latents.max_tokens must be in [1, 8192], got {self.max_tokens}")
        if self.cleaning not in CLEANINGS:
            raise ValueError(f"text_latents.cleaning must be one of {CLEANINGS}, got {self.cleaning!r}")
        if self.batch_size < 1:
            raise ValueError(f"text_latents.batch_size must be >= 1, got {self.batch_size}")

    def version(self) -> str:
        inputs = {"model": fingerprint_checkpoint(Path(self.model)), "preset": self.preset,
                  "max_tokens": self.max_tokens, "masks": self.masks, "cleaning": self.cleaning,
                  "format": LATENT_FORMAT}
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]

    def encoder_id(self, version: str | None = None) -> str:
        """Human-readable and stable: `<preset>:<12 hex of version>` (`version` when already computed:
        it fingerprints the checkpoint)."""
        return f"{self.preset}:{(version or self.version())[:12]}"


# What a latent's size is measured on: a VLM caption of the kind the captioner prompt asks for.
REFERENCE_CAPTION = (
    "A wide photograph of a quiet harbour at dusk. In the foreground, three small wooden fishing boats "
    "painted blue, red and white rest on calm water, their reflections broken by gentle ripples. A man in a "
    "yellow raincoat stands on the nearest boat, coiling a thick rope. Behind them, a stone pier leads to a "
    "row of narrow houses with orange roofs and lit windows. The sky fades from pale pink near the horizon "
    "to deep violet above, with a few thin clouds. Seagulls perch on wooden posts along the pier. The image "
    "is sharp, evenly exposed, with soft warm light and muted colours; no text or watermark is visible.")


def latent_sizing(config: TextLatentsConfig) -> tuple[int, float]:
    """(hidden size, tokens per word of the checkpoint's tokenizer on REFERENCE_CAPTION): what a plan
    needs to size latents, read from the checkpoint's files (config and tokenizer, no weights)."""
    from transformers import AutoTokenizer

    settings = json.loads((Path(config.model) / "config.json").read_text())
    hidden = (settings.get("text_config") or {}).get("hidden_size") or settings.get("hidden_size")
    if not hidden:
        raise ValueError(f"{config.model}/config.json names no hidden_size (nor text_config.hidden_size)")
    tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
    tokens = len(tokenizer(clean_caption(REFERENCE_CAPTION, config.cleaning))["input_ids"])
    return int(hidden), tokens / len(REFERENCE_CAPTION.split())


def clean_caption(text: str | None, cleaning: str = "basic") -> str:
    """PRX's basic cleaning (ftfy's mojibake repair, HTML entities unescaped twice, stripped);
    `none` encodes the caption as stored."""
    text = "" if text is None else str(text)
    if cleaning == "none":
        return text
    import ftfy

    return html.unescape(html.unescape(ftfy.fix_text(text))).strip()


def text_backbone(model: Any) -> Any:
    """The decoder stack whose last hidden state is the latent (no LM head, no vision tower)."""
    for owner in (model, getattr(model, "model", None)):
        backbone = getattr(owner, "language_model", None)
        if backbone is not None and not callable(getattr(backbone, "generate", None)):
            return backbone
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        return inner
    raise ValueError(f"{type(model).__name__}: no text backbone found (expected `language_model` or `model`)")


def encode_captions(model: Any, tokenizer: Any, captions: Sequence[str],
                    max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[Any, Any]:
    """(latents [B, max_tokens, hidden] bfloat16, attention mask [B, max_tokens] bool) for `captions`.

    Right-padded to exactly `max_tokens`, so every sample stores the same shape; the mask marks
    the caption's tokens (PRX stores it as `attention_mask_caption_<preset>`)."""
    import torch

    batch = tokenizer(list(captions), padding="max_length", truncation=True, max_length=max_tokens,
                      return_tensors="pt", padding_side="right")
    backbone = text_backbone(model)
    device = next(backbone.parameters()).device
    with torch.inference_mode():
        out = backbone(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    return out.last_hidden_state.to(torch.bfloat16), batch["attention_mask"].to(device).bool()


def load_text_model(path: str, device: str | None = None) -> tuple[Any, Any]:
    """(model in bfloat16 on `device`, tokenizer) of a local checkpoint, as PRX's text tower loads it:
    the whole conditional-generation model for a VLM (its checkpoint's key layout), else the LM."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    loader = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = loader.from_pretrained(path, local_files_only=True, dtype=torch.bfloat16).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:  # a plain LM: pad with EOS (masked out either way)
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def latent_rows(latents: Any, mask: Any, masks: bool) -> list[tuple[bytes, int]]:
    """Per caption: (the stored latent's bfloat16 bits, C order, and its valid token count). With
    masks only the caption's tokens are stored (PRX pads from the mask), else all rows."""
    import torch

    bits = latents.detach().to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16)
    counts = mask.sum(dim=1).tolist()
    return [((row[:n] if masks else row).tobytes(), int(n)) for row, n in zip(bits, counts)]


def encode_texts(model: Any, tokenizer: Any, config: TextLatentsConfig,
                 captions: Sequence[str | None]) -> list[tuple[bytes, int]]:
    """(latent bits, token count) per caption: cleaned, then encoded `config.batch_size` at a time."""
    texts = [clean_caption(c, config.cleaning) for c in captions]
    rows: list[tuple[bytes, int]] = []
    for start in range(0, len(texts), config.batch_size):
        latents, mask = encode_captions(model, tokenizer, texts[start:start + config.batch_size], config.max_tokens)
        rows += latent_rows(latents, mask, config.masks)
    return rows


def latent_outputs(encoded: Sequence[tuple[bytes, int] | None], hidden: int, encoder_id: str,
                   encoder_version: str) -> dict[str, np.ndarray]:
    """An encoder's output columns (None where a caption has no latent): `latent`, `tokens`,
    `hidden`, `encoder_id`, `encoder_version`."""
    n = len(encoded)
    return {"latent": np.array([e[0] if e else None for e in encoded], dtype=object),
            "tokens": np.array([e[1] if e else 0 for e in encoded], dtype=np.int32),
            "hidden": np.full(n, hidden, dtype=np.int32), "encoder_id": np.full(n, encoder_id, dtype=object),
            "encoder_version": np.full(n, encoder_version, dtype=object)}


class EncodeBatch:
    """A model actor's callable: one bfloat16 model per actor. In: `content_id`, `caption`.
    Out: `content_id` and the `latent_outputs` columns."""

    def __init__(self, config: TextLatentsConfig) -> None:
        self.config = config
        self.encoder_version = config.version()
        self.encoder_id = config.encoder_id(self.encoder_version)
        self.model, self.tokenizer = load_text_model(config.model, config.device)
        self.hidden = int(text_backbone(self.model).config.hidden_size)

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, np.ndarray]:
        content_ids = np.asarray(batch["content_id"], dtype=object)
        if len(content_ids) != len(batch["caption"]):
            raise ValueError(f"{len(content_ids)} content ids for {len(batch['caption'])} captions")
        encoded = encode_texts(self.model, self.tokenizer, self.config, list(batch["caption"]))
        return {"content_id": content_ids, **latent_outputs(encoded, self.hidden, self.encoder_id, self.encoder_version)}


def to_latent_rows(batch: Mapping[str, Any], captioner_version: str) -> pa.Table:
    """An encoder's columns (numpy arrays, or a pyarrow table's) as `text_latents` rows of
    `captioner_version`'s captions."""
    columns = {f.name: _column(batch[f.name], f.type) for f in schemas.TEXT_LATENTS if f.name != "captioner_version"}
    columns["captioner_version"] = pa.array([captioner_version] * len(batch["content_id"]), pa.string())
    return pa.table({f.name: columns[f.name] for f in schemas.TEXT_LATENTS}, schema=schemas.TEXT_LATENTS)


def _column(values: Any, kind: pa.DataType) -> Any:
    return values.cast(kind) if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values, kind)
