"""The training loader at PRX scale: a synthetic 1B-sample tier read by one node of 8 ranks x 8
dataloader workers (`prx-bench loader --scale`).

What the loader itself holds per node and how long it takes to start, with ~4,000 streams, ~1.4M
shards and 5% of the samples skipped. Streaming's own structures (its shard list and epoch plan,
~2.8 KB per shard per rank, measured in docs/scale.md) are outside what this measures; the
loader's are: the tier manifest (read once per node, its skip positions mapped and shared), the
per-stream plans and substitutes, and the index check (every stream's index.json hashed per rank).

The tier is synthetic and cached under `cache` (generated once, minutes): 4,000 index.json files
with 1.4M shard entries as `mds_shards` writes them (nothing else of the MDS), the sources' parts
as the publishers write them, then the tier manifest assembled by `assemble_tier` (timed: what
every publish of a source pays to reassemble its tier at this size).

Processes: 8 ranks (spawned, each `prx_core.shards.manifest` and `substitutes` imported), each
builds what `CorpusDataset` builds, then forks 8 dataloader workers (PyTorch's default on Linux)
that each run lookups over every stream. The baseline is the same tree of processes with the same
imports and no manifest, run just before: memory per node is the sum of PSS (a page shared by k
processes counts 1/k in each) over the tree, ours minus the baseline's; start-up is the wall time
until every rank and worker is ready, ours minus the baseline's.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

TIER = 512
BUCKETS = [(512, 512), (576, 448), (448, 576), (640, 384), (384, 640), (704, 320), (320, 704), (768, 320),
           (320, 768), (512, 448), (448, 512), (576, 384), (384, 576)]
SHARD_BYTES = 67_108_864


def spec(samples: int, streams: int, shards: int, skip: float, seed: int = 7) -> dict[str, Any]:
    return {"samples": samples, "streams": streams, "shards": shards, "skip": skip, "seed": seed, "version": 1}


def stream_layout(s: dict[str, Any]) -> list[tuple[str, int, int, int, int]]:
    """(source, w, h, count, shards) per stream: lognormal sizes summing to `samples`."""
    rng = np.random.default_rng(s["seed"])
    weights = rng.lognormal(0, 1.2, s["streams"])
    counts = np.maximum(1, np.floor(weights / weights.sum() * s["samples"])).astype(np.int64)
    counts[np.argmax(counts)] += s["samples"] - counts.sum()
    per_shard = s["samples"] / s["shards"]
    out = []
    for i, count in enumerate(counts.tolist()):
        w, h = BUCKETS[i % len(BUCKETS)]
        out.append((f"src{i // len(BUCKETS):04d}", w, h, count, max(1, round(count / per_shard))))
    return out


def shard_sizes(count: int, shards: int) -> list[int]:
    base, extra = divmod(count, shards)
    return [base + (k < extra) for k in range(shards)]


def _index(w: int, h: int, count: int, shards: int) -> bytes:
    """A stream's index.json as mds_shards writes it (merged chunk indexes), ~0.5 KB per shard."""
    entries = []
    for k, n in enumerate(shard_sizes(count, shards)):
        entries.append({"column_encodings": ["jpeg", "str", "str", "int", "int", "int", "int", "str", "str"],
                        "column_names": ["image", "caption", "original_caption", "width", "height",
                                         "original_width", "original_height", "sample_id", "source"],
                        "column_sizes": [None, None, None, 8, 8, 8, 8, None, None], "compression": None,
                        "format": "mds", "hashes": ["xxh64"], "size_limit": SHARD_BYTES, "version": 2,
                        "raw_data": {"basename": f"c-{k // 64:05d}/shard.{k % 64:05d}.mds", "bytes": SHARD_BYTES,
                                     "hashes": {"xxh64": f"{(k * 2654435761) % 2**64:016x}"}},
                        "samples": n, "zip_data": None, "raw_meta": None, "zip_meta": None})
    return json.dumps({"shards": entries, "version": 2}, sort_keys=True).encode()


def generate(root: Path, s: dict[str, Any], log=print) -> dict[str, Any]:
    """Write (once) the synthetic tier under `root`; returns what it took (cached with it)."""
    from prx_core.shards.manifest import StreamPlan, encode, entry, part_uri, shards_digest
    from prx_core.shards.manifest_publish import assemble_tier

    done = root / "generated.json"
    if done.exists() and json.loads(done.read_text())["spec"] == s:
        return json.loads(done.read_text())
    started = time.monotonic()
    rng = np.random.default_rng(s["seed"] + 1)
    by_source: dict[str, list[StreamPlan]] = {}
    index_bytes = 0
    layout = stream_layout(s)
    for i, (source, w, h, count, shards) in enumerate(layout):
        folder = root / "mds" / source / str(TIER) / f"{w}x{h}"
        folder.mkdir(parents=True, exist_ok=True)
        index = _index(w, h, count, shards)
        (folder / "index.json").write_bytes(index)
        index_bytes += len(index)
        skipped = np.sort(rng.choice(count, int(count * s["skip"]), replace=False)).astype(np.int64)
        by_source.setdefault(source, []).append(StreamPlan(
            source, TIER, w, h, str(folder), count, skipped, hashlib.sha256(index).hexdigest(),
            shards_digest(json.loads(index)), {"duplicate": len(skipped)}))
        if i % 500 == 499:
            log(f"  {i + 1}/{len(layout)} streams written ({time.monotonic() - started:.0f} s)")
    for source, plans in by_source.items():
        path = Path(part_uri(str(root), TIER, source))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode(TIER, [entry(p, str(root)) for p in plans], [p.skipped for p in plans], {},
                                {"source": source}))
    written = time.monotonic() - started
    t = time.monotonic()
    name = assemble_tier(str(root), TIER)
    record = {"spec": s, "generate_s": round(written, 1), "assemble_s": round(time.monotonic() - t, 1),
              "manifest_bytes": os.path.getsize(root / "manifests" / str(TIER) / name),
              "index_bytes": index_bytes, "sources": len(by_source)}
    done.write_text(json.dumps(record))
    return record


def _pss_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of a process in kB, from /proc/<pid>/smaps_rollup."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            parts = line.split()
            if parts[0] in ("Pss:", "Rss:"):
                fields[parts[0]] = int(parts[1])
    return fields["Pss:"], fields["Rss:"]


def _worker(plans_and_subs: Any, lookups: int, seed: int, ready: Any, release: Any) -> None:
    rng = np.random.default_rng(seed)
    if plans_and_subs is not None:
        plans, subs = plans_and_subs
        for i in rng.integers(0, len(plans), lookups).tolist():
            if subs[i] is not None:
                subs[i](int(rng.integers(0, plans[i].count)), 0)
    ready.put(("worker", os.getpid(), 0.0, {}))
    release.wait()


def _rank(root: str, workers: int, lookups: int, baseline: bool, rank: int, ready: Any, release: Any) -> None:
    from prx_core.shards.manifest import check_indexes, load_manifest
    from prx_core.shards.substitutes import Substitutes

    started, steps, state = time.monotonic(), {}, None
    if not baseline:
        manifest = load_manifest(root, TIER)
        steps["load_s"] = time.monotonic() - started
        plans = manifest.plans()
        steps["plans_s"] = time.monotonic() - started - steps["load_s"]
        t = time.monotonic()
        check_indexes(plans, [os.path.join(p.uri, "index.json") for p in plans], manifest)
        steps["check_s"] = time.monotonic() - t
        t = time.monotonic()
        layout = {(source, w, h): shards for source, w, h, _, shards in stream_layout(json.loads(
            Path(root, "generated.json").read_text())["spec"])}
        subs = [Substitutes(p.name, p.count, p.skipped, shard_sizes(p.count, layout[(p.source, p.width, p.height)]))
                if len(p.skipped) else None for p in plans]
        steps["substitutes_s"] = time.monotonic() - t
        state = (plans, subs)
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_worker, args=(state, lookups, rank * 100 + k, ready, release)) for k in range(workers)]
    for child in children:
        child.start()
    ready.put(("rank", os.getpid(), time.monotonic() - started, steps))
    release.wait()
    for child in children:
        child.join()


def run_node(root: str, ranks: int, workers: int, lookups: int, baseline: bool) -> dict[str, Any]:
    """One simulated node: ranks x workers processes; start-up wall time and the tree's PSS."""
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Queue(), ctx.Event()
    started = time.monotonic()
    procs = [ctx.Process(target=_rank, args=(root, workers, lookups, baseline, r, ready, release)) for r in range(ranks)]
    for p in procs:
        p.start()
    reports = [ready.get(timeout=1800) for _ in range(ranks * (workers + 1))]
    wall = time.monotonic() - started
    pss = rss = 0
    for _, pid, _, _ in reports:
        a, b = _pss_kb(pid)
        pss, rss = pss + a, rss + b
    release.set()
    for p in procs:
        p.join()
    rank_reports = [r for r in reports if r[0] == "rank"]
    steps = {k: round(float(np.mean([r[3][k] for r in rank_reports])), 2) for k in rank_reports[0][3]}
    return {"startup_s": round(wall, 1), "rank_ready_s_max": round(max(r[2] for r in rank_reports), 1),
            "pss_mb": round(pss / 1024), "rss_mb": round(rss / 1024), "processes": len(reports), **steps}


def run(cache: str, samples: int = 1_000_000_000, streams: int = 4000, shards: int = 1_400_000, skip: float = 0.05,
        ranks: int = 8, workers: int = 8, lookups: int = 20_000, log=print) -> dict[str, Any]:
    root = Path(cache) / f"tier-{samples}-{streams}-{shards}-{skip}"
    root.mkdir(parents=True, exist_ok=True)
    log(f"synthetic tier under {root} (generated once, then reused) ...")
    generated = generate(root, spec(samples, streams, shards, skip), log)
    log(f"baseline node: {ranks} ranks x {workers} workers, no manifest ...")
    base = run_node(str(root), ranks, workers, lookups, baseline=True)
    log(f"loader node: {ranks} ranks x {workers} workers, the manifest mapped, {lookups} lookups per worker ...")
    ours = run_node(str(root), ranks, workers, lookups, baseline=False)
    return {"generated": generated, "baseline": base, "loader": ours,
            "node_memory_mb": ours["pss_mb"] - base["pss_mb"], "node_startup_s": round(ours["startup_s"] - base["startup_s"], 1),
            "ranks": ranks, "workers": workers}


def format_table(r: dict[str, Any]) -> str:
    g, s = r["generated"], r["generated"]["spec"]
    lines = [f"tier: {s['samples']:,} samples, {s['streams']:,} streams in {g['sources']} sources, {s['shards']:,} shards, "
             f"{s['skip']:.0%} skipped; manifest {g['manifest_bytes'] / 2**20:.0f} MiB, index.json {g['index_bytes'] / 2**20:.0f} MiB; "
             f"generated in {g['generate_s']} s, assembled in {g['assemble_s']} s",
             "| node of ranks x workers | processes | start-up s | PSS MB | RSS MB |", "|---|---|---|---|---|"]
    for name in ("baseline", "loader"):
        n = r[name]
        lines.append(f"| {name} {r['ranks']} x {r['workers']} | {n['processes']} | {n['startup_s']} | {n['pss_mb']} | {n['rss_mb']} |")
    steps = {k: v for k, v in r["loader"].items() if k.endswith("_s") and k not in ("startup_s",)}
    lines.append(f"loader per node: +{r['node_memory_mb']} MB (PSS, over the baseline), +{r['node_startup_s']} s to start; "
                 f"per rank (mean s): {steps}")
    return "\n".join(lines)
