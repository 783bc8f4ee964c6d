"""How well a labeller labels captions a team labelled by hand: `prx-corpus eval-labels`.

A labeller is measured before a backfill on the team's own captions, written the way its
captioner writes them, because a labeller holds on the captions it was tuned on and is only known
to hold on others once measured (docs/benchmarks.md, "Caption labels"). In: JSON lines
`{"caption": ..., "label": "visual"|"text"|"nsfw"}`, optionally with a `kind` (what the caption
is: "incidental_text", "map", ...; mistakes are then counted per kind), a `split` and a `round` (when
the caption was written: a fresh round is measured alone with `--round`). Out:
accuracy, per-class precision and recall, the confusion matrix (a `failed` column when a backend
returned no label: an llm's unparseable answer or HTTP error counts as a miss), every mistake, and
for the minilm backend the captions nearest each decision boundary: the nsfw threshold, and the
text boundary (text wins when min(score(text) - text_threshold, score(text) - score(visual)) >= 0).
Any configured backend: minilm (head or similarity), llm over an OpenAI-compatible endpoint, llm
on vLLM through Ray Data (a Ray must be running).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prx_core.models.label_base import LABELS, LabelerConfig, LabelResult

FAILED = "failed"  # the confusion column of captions the backend returned no label for
MISTAKES_SHOWN = 40


class LabelledFileError(ValueError):
    """A labelled file that cannot be measured; the message names the file and line."""


@dataclass(frozen=True)
class Labelled:
    caption: str
    label: str
    kind: str = ""


def parse_rounds(text: str | None) -> frozenset[str] | None:
    """`--round` ("4", "1,2,3") as the set of round names it keeps; None keeps every line."""
    if text is None:
        return None
    rounds = frozenset(part.strip() for part in str(text).split(",") if part.strip())
    if not rounds:
        raise LabelledFileError(f"--round {text!r} names no round")
    return rounds


def read_labelled(path: str | Path, split: str | None = None, rounds: str | None = None) -> list[Labelled]:
    """The labelled captions of a JSON-lines file (only `split`'s, only those of `rounds`, a comma
    list of `round` values, when given); refuses bad lines."""
    keep_rounds = parse_rounds(rounds)
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise LabelledFileError(f"{where}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("caption"), str) or not row["caption"].strip():
            raise LabelledFileError(f"{where}: needs a non-blank string \"caption\"")
        if row.get("label") not in LABELS:
            raise LabelledFileError(f"{where}: \"label\" must be one of {', '.join(LABELS)}, got {row.get('label')!r}")
        if (split is None or row.get("split") == split) and (
                keep_rounds is None or str(row.get("round", "")) in keep_rounds):
            rows.append(Labelled(row["caption"], row["label"], str(row.get("kind") or "")))
    if not rows:
        raise LabelledFileError(f"{path}: no labelled captions" + (f" with split {split!r}" if split else "")
                                + (f" in round {rounds}" if rounds else ""))
    return rows


def label_captions(config: LabelerConfig, captions: Sequence[str]) -> list[LabelResult]:
    """The configured backend's result for every caption, in order, as `caption_labels` would get it."""
    if config.backend == "llm" and config.transport == "vllm":
        return label_with_vllm(config, captions)
    from prx_core.models.labels import build_labeler

    labeler, results = build_labeler(config), []
    for start in range(0, len(captions), config.batch_size):
        results.extend(labeler.label_batch(list(captions[start:start + config.batch_size])))
    return results


def label_with_vllm(config: LabelerConfig, captions: Sequence[str]) -> list[LabelResult]:
    """The llm labeller's vLLM stage (prx_core.models.labels_vllm) over the captions, on the running Ray."""
    import ray

    from prx_core.models.labels_vllm import label_dataset

    dataset = ray.data.from_items([{"content_id": str(i), "caption": c} for i, c in enumerate(captions)])
    return results_from_rows(label_dataset(dataset, config).take_all(), len(captions))


def results_from_rows(rows: Sequence[dict[str, Any]], n: int) -> list[LabelResult]:
    """Label rows (content_id = the caption's position) as results in caption order; a row that
    never came back is a `missing` failure."""
    out = [LabelResult("", 0.0, {}, "missing: no row came back") for _ in range(n)]
    for row in rows:
        out[int(row["content_id"])] = LabelResult(row["label"] or "", float(row["score"]), {}, row.get("error") or None)
    return out


@dataclass(frozen=True)
class Scored:
    """One caption as labelled: what it should be, what it got, and how far from flipping."""

    caption: str
    kind: str
    expected: str
    predicted: str  # FAILED when the backend returned no label
    scores: dict[str, float]
    error: str = ""
    margin: float | None = None  # signed distance to the boundary of a near-threshold list


@dataclass(frozen=True)
class Evaluation:
    labeler: str  # what was measured, in words (backend, method, thresholds)
    labeler_id: str
    captions: int
    accuracy: float
    confusion: dict[str, dict[str, int]]  # labelled -> predicted -> count
    per_class: dict[str, dict[str, float | int | None]]  # precision, recall, labelled, predicted
    failures: dict[str, int]  # error code -> count
    mistakes: list[Scored]
    by_kind: dict[str, dict[str, Any]]  # kinds with a mistake: captions, wrong, predicted counts
    nearest: dict[str, list[Scored]] = field(default_factory=dict)  # boundary name -> nearest captions

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def describe_config(config: LabelerConfig) -> str:
    if config.backend == "llm":
        return f"llm {config.model} over {config.transport} (constrained {config.constrained})"
    return (f"minilm {config.method}: text when score >= {config.text_threshold:g} and > visual, "
            f"nsfw when score >= {config.nsfw_threshold:g}")


def evaluate(labelled: Sequence[Labelled], results: Sequence[LabelResult], config: LabelerConfig,
             nearest: int = 5) -> Evaluation:
    """The measures of the module doc for results in `labelled` order."""
    if len(labelled) != len(results):
        raise ValueError(f"{len(results)} results for {len(labelled)} labelled captions")
    scored = [Scored(item.caption, item.kind, item.label, result.label if result.label in LABELS else FAILED,
                     dict(result.scores), result.error or "") for item, result in zip(labelled, results)]
    columns = [*LABELS, FAILED] if any(s.predicted == FAILED for s in scored) else list(LABELS)
    confusion = {e: {p: sum(s.expected == e and s.predicted == p for s in scored) for p in columns} for e in LABELS}
    per_class = {}
    for label in LABELS:
        hits, wanted = confusion[label][label], sum(confusion[label].values())
        predicted = sum(confusion[e][label] for e in LABELS)
        per_class[label] = {"precision": hits / predicted if predicted else None,
                            "recall": hits / wanted if wanted else None, "labelled": wanted, "predicted": predicted}
    mistakes = [s for s in scored if s.predicted != s.expected]
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({s.kind for s in mistakes if s.kind}):
        of_kind = [s for s in scored if s.kind == kind]
        by_kind[kind] = {"captions": len(of_kind), "wrong": sum(s.predicted != s.expected for s in of_kind),
                         "predicted": dict(Counter(s.predicted for s in of_kind))}
    return Evaluation(describe_config(config), config.labeler_id(), len(scored),
                      sum(s.predicted == s.expected for s in scored) / len(scored), confusion, per_class,
                      dict(Counter(s.error.split(":", 1)[0] for s in scored if s.error)), mistakes, by_kind,
                      nearest_boundaries(scored, config, nearest))


def nearest_boundaries(scored: Sequence[Scored], config: LabelerConfig, k: int) -> dict[str, list[Scored]]:
    """For minilm, the k captions nearest each boundary, with their signed margins; an llm
    answers a label without a score, so it has none."""
    if config.backend != "minilm" or k < 1:
        return {}
    with_scores = [s for s in scored if set(LABELS) <= set(s.scores)]

    def closest(items: list[Scored], margin: Any) -> list[Scored]:
        marked = [Scored(**{**asdict(s), "margin": round(float(margin(s)), 6)}) for s in items]
        return sorted(marked, key=lambda s: abs(s.margin or 0.0))[:k]

    nsfw = closest(with_scores, lambda s: s.scores["nsfw"] - config.nsfw_threshold)
    not_nsfw = [s for s in with_scores if s.scores["nsfw"] < config.nsfw_threshold]
    text = closest(not_nsfw, lambda s: min(s.scores["text"] - config.text_threshold, s.scores["text"] - s.scores["visual"]))
    return {f"nsfw threshold {config.nsfw_threshold:g}": nsfw,
            f"text boundary (threshold {config.text_threshold:g}, and above visual)": text}


def format_evaluation(ev: Evaluation, source: str = "") -> str:
    """The evaluation as the terminal shows it."""
    lines = [f"labeller {ev.labeler_id}: {ev.labeler}",
             f"{ev.captions} labelled captions{f' from {source}' if source else ''}",
             f"accuracy {ev.accuracy:.3f} ({round(ev.accuracy * ev.captions)} / {ev.captions})", "",
             f"{'label':<8} {'precision':>9} {'recall':>7} {'labelled':>9} {'predicted':>9}"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for label, m in ev.per_class.items():
        lines.append(f"{label:<8} {fmt(m['precision']):>9} {fmt(m['recall']):>7} {m['labelled']:>9} {m['predicted']:>9}")
    columns = list(next(iter(ev.confusion.values())))
    lines += ["", "confusion (rows: labelled, columns: predicted)", " " * 9 + "".join(f"{c:>8}" for c in columns)]
    lines += [f"{e:<9}" + "".join(f"{row[c]:>8}" for c in columns) for e, row in ev.confusion.items()]
    if ev.failures:
        lines += ["", "no label: " + ", ".join(f"{code} {n}" for code, n in sorted(ev.failures.items()))]
    lines += ["", f"mistakes: {len(ev.mistakes)}"]
    lines += [f"  {m.expected:>6} -> {m.predicted:<6} {m.kind:<18} {score_text(m)}  {excerpt(m.caption)}"
              for m in ev.mistakes[:MISTAKES_SHOWN]]
    if len(ev.mistakes) > MISTAKES_SHOWN:
        lines.append(f"  ... {len(ev.mistakes) - MISTAKES_SHOWN} more (--json has them all)")
    if ev.by_kind:
        lines += ["", "kinds with a mistake: " + "; ".join(
            f"{kind} {m['wrong']}/{m['captions']} wrong ({', '.join(f'{k} {v}' for k, v in sorted(m['predicted'].items()))})"
            for kind, m in ev.by_kind.items())]
    for boundary, items in ev.nearest.items():
        lines += ["", f"nearest the {boundary}: margin, labelled -> predicted"]
        lines += [f"  {s.margin:+.3f} {s.expected:>6} -> {s.predicted:<6} {excerpt(s.caption)}" for s in items]
    return "\n".join(lines)


def score_text(s: Scored) -> str:
    if s.error:
        return s.error[:40]
    return " ".join(f"{label[0]}={s.scores[label]:.2f}" for label in LABELS if label in s.scores)


def excerpt(caption: str, width: int = 90) -> str:
    text = " ".join(caption.split())
    return text if len(text) <= width else text[:width - 3] + "..."
