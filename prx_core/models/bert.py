"""A BERT encoder's forward pass in plain torch, and its fast tokenizer from `tokenizer.json`.

Why not `transformers.BertModel`: importing transformers costs ~5 s of a core per process beyond
torch itself, and every labeller and embedder actor is a fresh process (two per source in a build).
A BERT encoder is a few dozen lines: embeddings, then per layer self-attention and a GELU feed-forward,
each followed by a residual and LayerNorm. `prx_core.models.embeddings.MiniLM` runs it, and
tests/core/models/test_labels.py holds the result equal to sentence-transformers on the same folder.
Imports torch: import this module only where a model runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer


class BertEncoder:
    """The last hidden state of a BERT checkpoint folder (config.json, model.safetensors); inference only."""

    def __init__(self, folder: Path, device: str) -> None:
        config = json.loads((folder / "config.json").read_text())
        if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu" \
                or config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{folder}: not a BERT encoder with absolute positions and GELU ({config.get('model_type')})")
        self.heads, self.layers, self.eps = config["num_attention_heads"], config["num_hidden_layers"], config["layer_norm_eps"]
        weights = load_file(str(folder / "model.safetensors"), device=device)
        self.w = {k.removeprefix("bert."): v.float() for k, v in weights.items()}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps)

    def _dense(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, hidden) for token ids and their attention mask (1 = token, 0 = padding)."""
        batch, tokens = ids.shape
        x = (self.w["embeddings.word_embeddings.weight"][ids]
             + self.w["embeddings.position_embeddings.weight"][:tokens]
             + self.w["embeddings.token_type_embeddings.weight"][0])
        x = self._norm(x, "embeddings.LayerNorm")
        padding = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for i in range(self.layers):
            layer = f"encoder.layer.{i}"
            q, k, v = (self._dense(x, f"{layer}.attention.self.{p}").view(batch, tokens, self.heads, -1).transpose(1, 2)
                       for p in ("query", "key", "value"))
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=padding).transpose(1, 2).reshape(batch, tokens, -1)
            x = self._norm(self._dense(context, f"{layer}.attention.output.dense") + x, f"{layer}.attention.output.LayerNorm")
            hidden = F.gelu(self._dense(x, f"{layer}.intermediate.dense"))
            x = self._norm(self._dense(hidden, f"{layer}.output.dense") + x, f"{layer}.output.LayerNorm")
        return x


def load_tokenizer(folder: Path, max_tokens: int) -> Tokenizer:
    """The folder's fast tokenizer, truncating to `max_tokens` and padding to the batch's longest
    (tokenizer.json ships a fixed 128-token padding, which transformers' call arguments override)."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=max_tokens)
    padding = tokenizer.padding or {}
    tokenizer.enable_padding(pad_id=padding.get("pad_id", 0), pad_token=padding.get("pad_token", "[PAD]"))
    return tokenizer


def tokenize(tokenizer: Tokenizer, texts: list[str], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = tokenizer.encode_batch(texts)
    ids = torch.from_numpy(np.array([e.ids for e in encoded], dtype=np.int64)).to(device)
    mask = torch.from_numpy(np.array([e.attention_mask for e in encoded], dtype=np.int64)).to(device)
    return ids, mask
