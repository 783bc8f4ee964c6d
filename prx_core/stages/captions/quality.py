"""The caption checks inside the `captions` stage: which stored captions still need a verdict, the
verdict of a pipeline's answers, and the per-partition counts the `captions_quality` check reads.

A caption's verdict is stored with it (`captions.verdict`, `problem`, `attempts`): `ok`,
`retried` (the fallback decoding's answer passed), `rejected` (refused twice: kept for the
explorer, never shipped, never retried under the same captioner version: greedy decoding would
write it again) or `flagged` (a source caption with a problem, shipped). A caption stored before
the checks existed has none: each run checks its text (the checks that need no finish_reason),
re-captions those that fail and leaves the rest, so an existing corpus is mended where it needs
it without re-captioning what was fine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.models.caption_base import SOURCE, CaptionerConfig, CaptionResult
from prx_core.models.caption_checks import OK, REJECTED, check_generated
from prx_core.models.captioning import judged

QUALITY_COLUMNS = ["content_id", "error", "verdict", "problem"]


def quality_key(verdict: str | None, problem: str | None) -> str:
    """The `quality` counter's key of one caption: "<verdict>" or "<verdict>:<problem>"."""
    verdict = verdict or OK  # stored before the checks and passing them now
    return f"{verdict}:{problem}" if problem else verdict


def refused_unchecked(config: CaptionerConfig, texts: pa.Table) -> list[str]:
    """Of captions stored without a verdict (content_id, caption), the keys whose text the checks
    refuse now: they are captioned again. Source captions are never refused."""
    if config.backend == SOURCE or not config.check_captions:
        return []
    return [key for key, text in zip(texts["content_id"].to_pylist(), texts["caption"].to_pylist())
            if not check_generated(text, None, min_words=config.min_words, max_words=config.max_words).ok]


def stored_quality(stored: pa.Table, keys: Iterable[str]) -> dict[str, int]:
    """The `quality` counts of the stored captions of `keys` (stored: QUALITY_COLUMNS rows)."""
    wanted = set(keys)
    ok = stored.filter(pc.equal(stored["error"], ""))
    return dict(Counter(quality_key(v, p) for k, v, p in zip(ok["content_id"].to_pylist(), ok["verdict"].to_pylist(),
                                                            ok["problem"].to_pylist()) if k in wanted))


def rejected_detail(keys: Sequence[str], problems: Sequence[str], owners: Mapping[str, Sequence[str]],
                    limit: int) -> list[list[str]]:
    """(content_id, problem, sample_id) of a few rejected captions: the quality check's offenders."""
    return [[*owners.get(k, (k, ""))[:1], p, owners.get(k, (k, ""))[1]] for k, p in list(zip(keys, problems))[:limit]]


def judged_rows(batch: pa.Table, config: CaptionerConfig, attempts: int = 1) -> pa.Table:
    """Caption rows of a backend that did not check them (the vLLM pipeline) with their verdicts.
    `attempts` 2: the fallback decoding's answers, whose rows carry the first attempt's problem and
    tokens (`first_problem`, `first_tokens`): a pass is `retried` under the first problem, a
    refusal is final, and the tokens add up as the other backends count them."""
    if "verdict" in batch.column_names:
        return batch
    reasons = batch["finish_reason"].to_pylist() if "finish_reason" in batch.column_names else [None] * batch.num_rows
    checked = [judged(CaptionResult(None, error) if error else CaptionResult(caption or "", finish_reason=reason or None),
                      config, attempts) for caption, error, reason in
               zip(batch["caption"].to_pylist(), batch["error"].to_pylist(), reasons)]
    columns: dict[str, list[Any]] = {
        "caption": [c.result.caption or "" for c in checked], "finish_reason": [reason or "" for reason in reasons],
        "verdict": [c.verdict for c in checked], "problem": [c.problem for c in checked],
        "attempts": [c.attempts for c in checked]}
    if attempts > 1:
        first = batch["first_problem"].to_pylist()
        columns["problem"] = [problem or earlier for problem, earlier in zip(columns["problem"], first)]
        columns["num_generated_tokens"] = [int(a or 0) + int(b or 0) for a, b in zip(
            batch["num_generated_tokens"].to_pylist(), batch["first_tokens"].to_pylist())]
    for name, values in columns.items():
        column = pa.array(values, pa.int64() if name in ("attempts", "num_generated_tokens") else pa.string())
        batch = (batch.set_column(batch.schema.get_field_index(name), name, column) if name in batch.column_names
                 else batch.append_column(name, column))
    return batch


def retryable(rows: pa.Table, config: CaptionerConfig) -> pa.Array:
    """Which judged first answers the fallback decoding generates again: the refused ones of a
    checking model captioner (a failure is retried by the next run instead)."""
    if config.backend == SOURCE or not config.check_captions:
        return pa.array([False] * rows.num_rows)
    return pc.and_(pc.equal(pc.fill_null(rows["verdict"], ""), REJECTED), pc.equal(rows["error"], ""))


def new_quality(rows: pa.Table) -> dict[str, Any]:
    """This run's counts over its caption rows: the `quality` counter, fallback generations made."""
    verdicts, problems = rows["verdict"].to_pylist(), rows["problem"].to_pylist()
    errors, attempts = rows["error"].to_pylist(), rows["attempts"].to_pylist()
    return {"quality": dict(Counter(quality_key(v, p) for v, p, e in zip(verdicts, problems, errors) if not e)),
            "fallbacks": sum(1 for a in attempts if (a or 0) >= 2),
            "rejected_now": sum(1 for v, e in zip(verdicts, errors) if v == REJECTED and not e)}


def quality_table(quality: Mapping[str, int]) -> list[dict[str, Any]]:
    """problem -> captions per verdict (retried, rejected, flagged), for the asset's metadata."""
    rows: dict[str, Counter[str]] = {}
    for key, count in quality.items():
        verdict, _, problem = key.partition(":")
        if problem:
            rows.setdefault(problem, Counter())[verdict] += count
    return [{"problem": p, **{v: int(c[v]) for v in ("retried", "rejected", "flagged")}} for p, c in sorted(rows.items())]


def verdict_counts(quality: Mapping[str, int]) -> dict[str, int]:
    """verdict -> captions, from the `quality` counter."""
    out: Counter[str] = Counter()
    for key, count in quality.items():
        out[key.partition(":")[0]] += count
    return dict(out)


def detail_owners(owned: pa.Table) -> dict[str, Sequence[str]]:
    """caption key -> (content_id, sample_id) of the sample that owns it: offenders name a sample
    even where the key is not a content (the `source` captioner's keys)."""
    return {k: (c, s) for k, c, s in zip(owned["caption_key"].to_pylist(), owned["content_id"].to_pylist(),
                                         owned["sample_id"].to_pylist())}
