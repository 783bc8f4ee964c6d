"""The explorer latency benchmark's queries: what each query class asks, how one class is timed
on an open dataset (as the explorer UI would: one query at a time, after warm-ups) and what its
plan says about index use.

Query classes (limit / k = 50; the filtered ones use `prefilter=True`):

- fts_common: one frequent content word (in 40-60% of the captions)
- fts_medium: one mid-frequency word (in ~0.4-1.5% of the captions)
- fts_rare: one planted word (5 to 50 rows)
- fts_multi: three words (a common and two medium ones, OR-ed and ranked by BM25)
- fts_filtered: a medium word with `source = 'crawl_wds'`
- nn: 50 nearest neighbours of a fresh vector from the same clusters
- nn_filtered: the same with `source = 'crawl_wds'`
- nn_norefine: `nn` without the exact re-ranking (`refine_factor=None`): what refining costs and buys
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from lance import LanceDataset

from benchmarks.explorer_data import FILTER_SOURCE, PLANTED, K, Workload
from prx_core.store.lance_io import require_table
from prx_core.store.maintenance import _unindexed_fragments


@dataclass(frozen=True)
class QueryClass:
    """One row of the report: a kind of explorer query, varied by query number."""

    name: str
    kind: str  # "fts" | "nn"
    make: Callable[[int], dict[str, Any]]  # query number -> scanner keyword arguments


def query_classes(work: Workload, nprobes: int, refine_factor: int) -> list[QueryClass]:
    """The eight classes of the module docstring, in report order."""
    planted = list(PLANTED)
    common, medium = work.common, work.medium
    source_filter = f"source = '{FILTER_SOURCE}'"

    def fts(terms: Callable[[int], str], **extra: Any) -> Callable[[int], dict[str, Any]]:
        return lambda i: {"full_text_query": terms(i), "limit": K, **extra}

    def nn(refine: int | None = refine_factor, **extra: Any) -> Callable[[int], dict[str, Any]]:
        return lambda i: {"nearest": {"column": "embedding", "q": work.queries[i % len(work.queries)], "k": K,
                                      "nprobes": nprobes, "refine_factor": refine}, **extra}

    return [
        QueryClass("fts_common", "fts", fts(lambda i: common[i % len(common)])),
        QueryClass("fts_medium", "fts", fts(lambda i: medium[i % len(medium)])),
        QueryClass("fts_rare", "fts", fts(lambda i: planted[i % len(planted)])),
        QueryClass("fts_multi", "fts", fts(lambda i: f"{common[i % len(common)]} {medium[i % len(medium)]} "
                                                     f"{medium[(i + 3) % len(medium)]}")),
        QueryClass("fts_filtered", "fts", fts(lambda i: medium[i % len(medium)], filter=source_filter, prefilter=True)),
        QueryClass("nn", "nn", nn()),
        QueryClass("nn_filtered", "nn", nn(filter=source_filter, prefilter=True)),
        QueryClass("nn_norefine", "nn", nn(refine=None)),
    ]


def _columns(kind: str) -> list[str]:
    """What the explorer shows for a hit: its id, source, caption and score."""
    return ["content_id", "source", "caption", "_score" if kind == "fts" else "_distance"]


def run_query(ds: LanceDataset, kind: str, kwargs: dict[str, Any]) -> pa.Table:
    """One query, returning the columns the explorer shows."""
    return ds.to_table(columns=_columns(kind), disable_scoring_autoprojection=True, **kwargs)


def index_use(plan: str, kind: str) -> str:
    """"index" (index only), "index+flat" (some fragments searched without it) or "flat"."""
    lines = [line.strip() for line in plan.splitlines()]
    if kind == "fts":
        indexed = any(line.startswith("MatchQuery") or line.startswith("PhraseQuery")
                      or line.startswith("BooleanQuery") for line in lines)
        flat = any(line.startswith("Flat") for line in lines)
    else:
        indexed = any(line.startswith("ANNSubIndex") for line in lines)
        flat = any(line.startswith("LanceScan") and "embedding" in line for line in lines) or not indexed
    return "index+flat" if indexed and flat else "index" if indexed else "flat"


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile as a plain float (JSON-serializable)."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


def measure(ds: LanceDataset, qc: QueryClass, queries: int, warmups: int, work: Workload) -> dict[str, Any]:
    """Latency of `queries` sequential queries after `warmups` (query numbers 0..warmups-1)."""
    plan = ds.scanner(columns=_columns(qc.kind), disable_scoring_autoprojection=True,
                      **qc.make(warmups)).explain_plan(verbose=False)
    cold = None
    for i in range(warmups):
        t0 = time.perf_counter()
        run_query(ds, qc.kind, qc.make(i))
        cold = (time.perf_counter() - t0) * 1000 if cold is None else cold
    times, hits, recalls, bad_source = [], [], [], 0
    for i in range(warmups, warmups + queries):
        kwargs = qc.make(i)
        t0 = time.perf_counter()
        result = run_query(ds, qc.kind, kwargs)
        times.append((time.perf_counter() - t0) * 1000)
        hits.append(result.num_rows)
        if "filter" in kwargs:
            bad_source += sum(s != FILTER_SOURCE for s in result["source"].to_pylist())
        if qc.kind == "nn":
            exact = (work.exact_filtered if "filter" in kwargs else work.exact).ids[i % len(work.queries)]
            recalls.append(len(set(result["content_id"].to_pylist()) & set(exact)) / len(exact))
    out = {"p50_ms": percentile(times, 50), "p95_ms": percentile(times, 95), "mean_ms": float(np.mean(times)),
           "max_ms": max(times), "cold_ms": cold, "hits_mean": float(np.mean(hits)), "index": index_use(plan, qc.kind),
           "scalar_index": "ScalarIndexQuery" in plan, "wrong_source": bad_source, "_times": times}
    if recalls:
        out["recall"] = float(np.mean(recalls))
    return out


def planted_hits(ds: LanceDataset) -> dict[str, int]:
    """Rows found by the full-text index for each planted word (no limit)."""
    return {word: ds.to_table(columns=["content_id"], full_text_query=word, disable_scoring_autoprojection=True).num_rows
            for word in PLANTED}


def unindexed_fragments(ds: LanceDataset) -> dict[str, int]:
    """Fragments each index misses: those a query searches by a flat scan."""
    return {desc.name: len(_unindexed_fragments(ds, desc)) for desc in ds.describe_indices()}


def measure_phase(uri: str, classes: list[QueryClass], queries: int, warmups: int, work: Workload,
                  phase: str) -> dict[str, Any]:
    """Every class on a freshly opened dataset; keys `<class>_<measure>_<phase>`, plus the pooled
    single-term FTS percentiles, the planted words' hits and the unindexed fragments when the
    three single-term FTS classes are among `classes`."""
    ds = require_table(uri)
    out: dict[str, Any] = {}
    pooled_fts: list[float] = []
    for qc in classes:
        m = measure(ds, qc, queries, warmups, work)
        times = m.pop("_times")
        if qc.name in ("fts_common", "fts_medium", "fts_rare"):
            pooled_fts += times
        for key, value in m.items():
            out[f"{qc.name}_{key}_{phase}"] = value
        print(f"  {phase:6s} {qc.name:13s} p50 {m['p50_ms']:8.1f} ms  p95 {m['p95_ms']:8.1f} ms  "
              f"{m['index']:10s} hits {m['hits_mean']:5.1f}" + (f"  recall {m['recall']:.3f}" if "recall" in m else ""),
              flush=True)
    if not pooled_fts:
        return out
    out[f"fts_p50_ms_{phase}"] = percentile(pooled_fts, 50)
    out[f"fts_p95_ms_{phase}"] = percentile(pooled_fts, 95)
    hits = planted_hits(ds)
    out[f"rare_hits_{phase}"] = hits
    out[f"rare_hits_ok_{phase}"] = hits == PLANTED
    out[f"unindexed_fragments_{phase}"] = unindexed_fragments(ds)
    return out
