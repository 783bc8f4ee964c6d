"""`prx-bench dedup`: deduplication measured through the pipeline on labelled real photos.

The labelled set (benchmarks.dedup_set) is written as one `imagefolder` source and built with
`prx-corpus build --select raw_source,samples,buckets,phashes,duplicates`, once per rule (the
default match keys confirmed by signatures, and the first release's identical pHash). What the
`duplicates` table says is then scored against the labels:

- recall per kind of copy: the copy is in its original's group;
- groups joining two different pictures (variants count as pictures of their own);
- copies left per picture: the picture's original and copies not skipped (1 is ideal);
- the keeper: one of the best copies (most pixels, then lossless, JPEG quality, bytes), and its kind.

The peer, `imagehash.phash` on the same files (full decode), is grouped the way such scripts do:
connected components of pairs within a Hamming radius (0 and 4), without confirmation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks.dedup_set import DUPLICATE_KINDS, Labelled, write_dedup_set

SOURCE = "dedup"
STAGES = "raw_source,samples,buckets,phashes,duplicates"
RULES = ("keys", "phash")
PEER_RADII = (0, 4)


def run(pictures: int | None = None, workdir: str | None = None, keep: bool = False,
        rules: tuple[str, ...] = RULES) -> dict[str, Any]:
    """Build the set, run it through the pipeline under each rule, score them and the peer."""
    base = Path(workdir or tempfile.mkdtemp(prefix="prx-bench-dedup-"))
    started = time.time()
    labels = write_dedup_set(base / "set", limit=pictures)
    results: dict[str, Any] = {"files": len(labels), "pictures": len({x.of for x in labels}),
                               "kinds": dict(Counter(x.kind for x in labels)), "set_seconds": time.time() - started}
    for rule in rules:
        started = time.time()
        groups = _pipeline_groups(base, rule)
        results[f"pipeline_{rule}"] = {**score(labels, groups), "seconds": round(time.time() - started, 1)}
    results.update(_peer(base / "set", labels))
    results["decode_paths"] = decode_paths(pictures)
    if not keep and workdir is None:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return results


def _pipeline_groups(base: Path, rule: str) -> dict[str, dict[str, Any]]:
    """file name -> its `duplicates` row (files in no component are absent), after a build."""
    from prx_core.sources.catalog import SourceSpec, dump_catalog
    from prx_core.store import lance_io
    from prx_core.store.storage import Storage

    catalog, root = base / "sources.yaml", base / f"corpus-{rule}"
    dump_catalog([SourceSpec(SOURCE, "imagefolder", str(base / "set" / "images"))], catalog)
    config = base / f"config-{rule}.yaml"
    config.write_text(json.dumps({"skip_policy": {"duplicates_rule": rule}}))
    env = {**os.environ, "LANCE_LOG": "error"}
    command = [sys.executable, "-m", "prx_cli", "build", "--sources", str(catalog), "--root", str(root),
               "--select", STAGES, "--config", str(config)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"prx-corpus build failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = lance_io.read_table(Storage(str(root)).lance_uri("duplicates")).to_pylist()
    return {row["sample_id"].split("/", 1)[1]: row for row in rows}


def score(labels: list[Labelled], rows: dict[str, dict[str, Any]], keeper_facts: bool = True) -> dict[str, Any]:
    """The measures of one grouping: `rows` maps a file's stem to its group (group_id, keeper,
    keeper_sample_id; a file absent is alone)."""
    stem = {x.file_name: x.file_name.rsplit(".", 1)[0] for x in labels}
    group_of = {x.file_name: rows[stem[x.file_name]]["group_id"] if stem[x.file_name] in rows else f"alone:{x.file_name}"
                for x in labels}
    original = {x.picture: x.file_name for x in labels if x.kind == "original"}
    recall: dict[str, list[bool]] = defaultdict(list)
    for x in labels:
        if x.duplicate:
            recall[x.kind].append(group_of[x.file_name] == group_of[original[x.picture]])
    members: dict[str, set[str]] = defaultdict(set)
    for x in labels:
        members[group_of[x.file_name]].add(x.picture)
    merged = sorted(sorted(p) for p in members.values() if len(p) > 1)
    copies = [x for x in labels if x.duplicate or x.kind == "original"]
    if keeper_facts:  # a copy is left when it is not a loser
        kept = Counter(x.picture for x in copies if stem[x.file_name] not in rows or rows[stem[x.file_name]]["keeper"])
    else:  # a grouping without keepers: one copy left per group
        kept = Counter(p for p, _ in {(x.picture, group_of[x.file_name]) for x in copies})
    out: dict[str, Any] = {
        "recall": {k: round(sum(v) / len(v), 4) for k, v in sorted(recall.items(), key=lambda kv: _kind_order(kv[0]))},
        "recall_reencodes": _rate(recall, ("jpeg_q75", "jpeg_q85", "jpeg_q95", "png", "webp_lossless", "webp_q90")),
        "recall_resizes": _rate(recall, ("resize_75", "resize_50", "resize_50_q75")),
        "merged_groups": len(merged), "merged_examples": merged[:10],
        "copies_left_per_picture": round(sum(kept.values()) / max(len(original), 1), 3),
        "pictures_with_one_copy_left": sum(1 for p in original if kept[p] == 1),
    }
    if keeper_facts:
        out.update(_keepers(labels, rows, stem))
    return out


def _keepers(labels: list[Labelled], rows: dict[str, dict[str, Any]], stem: dict[str, str]) -> dict[str, Any]:
    """Whether each picture's keeper is one of its best copies, and of which kind the keepers are."""
    by_stem = {stem[x.file_name]: x for x in labels}
    wrong, kinds = [], Counter()
    for name, row in rows.items():
        if not row["keeper"] or row["group_size"] < 2:
            continue
        group = [r for r in rows.values() if r["group_id"] == row["group_id"]]
        best = max(_rank(r) for r in group)
        kinds[by_stem[name].kind] += 1
        if _rank(row) != best:
            wrong.append(name)
    return {"keeper_right": not wrong, "keepers_wrong": wrong[:10], "keeper_kinds": dict(kinds.most_common())}


def _rank(row: dict[str, Any]) -> tuple:
    return (row["pixels"], bool(row.get("lossless")), row.get("jpeg_quality") or 0, row.get("num_bytes") or 0)


def _rate(recall: dict[str, list[bool]], kinds: tuple[str, ...]) -> float:
    found = [x for k in kinds for x in recall.get(k, [])]
    return round(sum(found) / max(len(found), 1), 4)


def _kind_order(kind: str) -> int:
    return DUPLICATE_KINDS.index(kind) if kind in DUPLICATE_KINDS else len(DUPLICATE_KINDS)


def _peer(folder: Path, labels: list[Labelled]) -> dict[str, Any]:
    """`imagehash.phash` of every file (full decode), grouped within each radius of `PEER_RADII`."""
    try:
        import imagehash
        from PIL import Image
    except ImportError:  # a test-extra package: the runtime environment has no peer
        return {f"imagehash_r{r}": None for r in PEER_RADII}
    hashes = {}
    for x in labels:
        with Image.open(folder / "images" / x.file_name) as image:
            hashes[x.file_name] = int(str(imagehash.phash(image.convert("RGB"))), 16)
    out = {}
    for radius in PEER_RADII:
        parent = {f: f for f in hashes}

        def find(f: str) -> str:
            while parent[f] != f:
                parent[f] = parent[parent[f]]
                f = parent[f]
            return f

        names = sorted(hashes)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if (hashes[a] ^ hashes[b]).bit_count() <= radius:
                    parent[find(a)] = find(b)
        rows = {f.rsplit(".", 1)[0]: {"group_id": find(f)} for f in names}
        out[f"imagehash_r{radius}"] = score(labels, rows, keeper_facts=False)
    return out


def decode_paths(pictures: int | None = None) -> dict[str, Any]:
    """The same pixels as JPEG q95 (hashed from its DCT-scaled decode), PNG and lossless WebP (full
    decodes), at 100%, 75% and 50%: how often the pHash is equal, and how often the fingerprints
    say "same picture" (a shared key, signatures confirmed), per size and against the 100% PNG."""
    import io

    import numpy as np
    from PIL import Image

    from benchmarks.dedup_set import load_pictures
    from prx_core.image.fingerprint import signature_distance
    from prx_core.sources.ingest import inspect_image

    def facts(image: Image.Image, fmt: str, **options: Any) -> Any:
        buffer = io.BytesIO()
        image.save(buffer, fmt, **options)
        return inspect_image(buffer.getvalue())

    def same(a: Any, b: Any) -> bool:
        sigs = [np.frombuffer(x.signature, np.uint8)[None] for x in (a, b)]
        return bool(set(a.match_keys) & set(b.match_keys)) and float(signature_distance(*sigs)[0]) <= 1

    rates: dict[str, list[bool]] = defaultdict(list)
    for _, image in load_pictures(pictures):
        reference = None
        for scale in (100, 75, 50):
            pixels = image if scale == 100 else image.resize((image.width * scale // 100, image.height * scale // 100),
                                                             Image.Resampling.LANCZOS)
            jpeg, png, webp = facts(pixels, "JPEG", quality=95), facts(pixels, "PNG"), facts(pixels, "WEBP", lossless=True)
            reference = reference or png
            rates[f"{scale}%: PNG = lossless WebP (whole fingerprint)"].append(
                (png.phash, png.match_keys, png.signature) == (webp.phash, webp.match_keys, webp.signature))
            rates[f"{scale}%: JPEG q95 pHash = PNG pHash"].append(jpeg.phash == png.phash)
            rates[f"{scale}%: JPEG q95 same picture as PNG"].append(same(jpeg, png))
            if scale != 100:
                rates[f"{scale}%: pHash = 100% PNG pHash"].append(png.phash == reference.phash)
                rates[f"{scale}%: same picture as 100% PNG"].append(same(png, reference) and same(jpeg, reference))
    return {name: round(sum(v) / len(v), 4) for name, v in rates.items()}


def format_table(results: dict[str, Any]) -> str:
    """Recall per kind and the other measures, one column per rule and peer."""
    columns = [(f"pipeline ({rule})", results.get(f"pipeline_{rule}")) for rule in RULES] + \
              [(f"imagehash r<={r}", results.get(f"imagehash_r{r}")) for r in PEER_RADII]
    columns = [(name, col) for name, col in columns if col]
    kinds = list(columns[0][1]["recall"]) if columns else []
    head = f"{results['pictures']} pictures, {results['files']} files (copies: {', '.join(kinds)})\n"
    lines = [f"{'':<28}" + "".join(f"{name:>20}" for name, _ in columns)]
    for kind in kinds:
        lines.append(f"recall {kind:<21}" + "".join(f"{col['recall'].get(kind, 0):>20.3f}" for _, col in columns))
    for key, label in (("recall_reencodes", "recall, re-encodes"), ("recall_resizes", "recall, resizes"),
                       ("merged_groups", "groups of 2+ pictures"), ("copies_left_per_picture", "copies left / picture"),
                       ("pictures_with_one_copy_left", "pictures with one left")):
        lines.append(f"{label:<28}" + "".join(f"{col[key]:>20}" for _, col in columns))
    keeper = results.get("pipeline_keys") or {}
    if keeper:
        lines.append(f"keeper right in every group: {keeper['keeper_right']}; keepers by kind: {keeper['keeper_kinds']}")
        lines.append(f"merged (keys): {keeper['merged_examples'] or 'none'}")
    lines += ["", "decode paths (the same pixels in three files, three sizes):"]
    lines += [f"  {name:<52}{rate:>8.3f}" for name, rate in (results.get("decode_paths") or {}).items()]
    return head + "\n".join(lines)
