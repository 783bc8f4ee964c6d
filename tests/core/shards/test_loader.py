"""The training loader over real MDS (written by prx_core.shards.mds.streams) and real skip-lists.

Small shards (a few samples each, SIZE_LIMIT patched) so substitution inside a shard, and the
fallback when a whole shard is skipped, run on real data.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata
from streaming import Stream, StreamingDataLoader, StreamingDataset

import prx_core.shards.mds.streams as mds
import prx_core.shards.mds.publish as publish
from prx_core.image.imaging import encode_jpeg
from prx_core.shards.loader import CorpusDataset, StreamPlan, collate
from prx_core.shards.manifest import MissingManifest
from prx_core.shards.manifest_publish import publish_source_manifest
from prx_core.shards.skiplists.files import SkipList, index_digest
from prx_core.shards.skiplists.publish import write_skip_lists
from prx_core.shards.skiplists.records import UnfilteredStream
from prx_core.shards.substitutes import Substitutes

REPO = Path(__file__).resolve().parents[3]
# (source, tier, w, h, count): counts of the main streams are multiples of 8 (two ranks x batch 4)
LAYOUT = [("alpha", 512, 512, 512, 40), ("alpha", 512, 576, 448, 32), ("alpha", 512, 448, 576, 24),
          ("alpha", 512, 640, 384, 3), ("alpha", 1024, 1024, 1024, 2), ("beta", 512, 512, 512, 24),
          ("gamma", 512, 512, 512, 8)]
SKIPS = {("alpha", 512, 512, 512): {"duplicate": [1, 2, 3, 10, 11, 12, 13, 14], "nsfw": [3, 39]},
         ("alpha", 512, 576, 448): {"text": [0, 31]}, ("gamma", 512, 512, 512): {"opt_out": list(range(8))}}
TINY, EMPTY = "alpha/512/640x384", "gamma/512/512x512"
MAIN = ["alpha", "beta"]


def make_rows(source: str) -> list[dict]:
    photos = [Image.fromarray(getattr(skdata, n)()).convert("RGB") for n in ("astronaut", "chelsea", "coffee")]
    rows, i = [], 0
    for src, tier, w, h, count in LAYOUT:
        for _ in range(count if src == source else 0):
            photo = photos[i % 3]
            crop = photo.crop((i % 13, i % 7, photo.width - i % 5, photo.height))
            rows.append({"tier": tier, "bucket_width": w, "bucket_height": h, "width": w, "height": h,
                         "jpeg": encode_jpeg(crop.resize((w, h), Image.Resampling.BILINEAR)),
                         "caption": f"caption {i}", "original_caption": f"orig {i}",
                         "original_width": photo.width, "original_height": photo.height,
                         "sample_id": f"{source}-{i:04d}", "source": source})
            i += 1
    return rows


def skip_lists(source: str, summaries: list[publish.StreamSummary], options: dict | None = None) -> list[SkipList]:
    out = []
    for s in summaries:
        for reason, indices in SKIPS.get((source, s.tier, s.width, s.height), {}).items():
            out.append(SkipList(source, s.tier, s.width, s.height, reason, "p1", indices,
                                [s.sample_ids[i] for i in indices], s.count, index_digest(s.uri, options)))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two roots with the same MDS: `plain` filtered with nothing to skip (completion records,
    no lists), `skip` with skip-lists."""
    base = tmp_path_factory.mktemp("loader")
    plain, skip = str(base / "plain"), str(base / "skip")
    rows, skipped, streams, lists = {}, set(), {}, {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mds, "SIZE_LIMIT", 150_000)  # ~2-4 samples per shard
        for source in ("alpha", "beta", "gamma"):
            rows[source] = make_rows(source)
            summaries = publish.write_source_streams(rows[source], plain, source)
            for s in summaries:
                streams[f"{source}/{s.tier}/{s.width}x{s.height}"] = s
            lists[source] = skip_lists(source, summaries)
            skipped |= {sid for sl in lists[source] for sid in sl.sample_ids}
            write_skip_lists(plain, source, [])
    shutil.copytree(Path(plain, "mds"), Path(skip, "mds"))
    for source, source_lists in lists.items():
        write_skip_lists(skip, source, source_lists)
    assert streams["alpha/512/512x512"].shards > 5
    return {"plain": plain, "skip": skip, "rows": rows, "skipped": skipped, "streams": streams}


def load(root: str, **kwargs) -> CorpusDataset:
    kwargs = {"sources": MAIN, "batch_size": 4, "shuffle": True, "shuffle_seed": 7, **kwargs}
    with pytest.warns(UserWarning, match=f"{TINY} left out"):
        return CorpusDataset(root, 512, **kwargs)


def epochs(ds: CorpusDataset, n: int = 2) -> list[list[str]]:
    out = [[s["sample_id"] for s in ds] for _ in range(n)]
    del ds
    gc.collect()
    return out


def test_skipped_samples_are_substituted_within_their_stream_and_epoch_length_is_kept(corpus) -> None:
    ds = load(corpus["skip"])
    assert ds.stream_names == ["alpha/512/448x576", "alpha/512/512x512", "alpha/512/576x448", "beta/512/512x512"]
    assert ds.left_out == {TINY: "3 samples per epoch cannot fill a batch of 4"}
    direct = [ds[i]["sample_id"] for i in range(ds.num_samples)]
    with_skips = epochs(ds)
    without = epochs(load(corpus["plain"]))
    stream_of = {i: name for name, s in corpus["streams"].items() for i in s.sample_ids}
    assert not set(direct) & corpus["skipped"]
    for got, plain in zip(with_skips, without):
        assert len(got) == len(plain) == 120 and not set(got) & corpus["skipped"]
        for a, b in zip(got, plain):  # same plan; only skipped slots differ, within their stream
            assert a == b if b not in corpus["skipped"] else stream_of[a] == stream_of[b]
    assert with_skips[0] != with_skips[1]  # shuffled per epoch, substitutes rotate


def test_fully_skipped_stream_is_left_out_and_stale_skip_lists_are_refused(corpus, tmp_path) -> None:
    with pytest.warns(UserWarning, match=f"{EMPTY} left out: every sample is skipped"):
        ds = CorpusDataset(corpus["skip"], 512, sources=["beta", "gamma"], batch_size=4)
    assert ds.stream_names == ["beta/512/512x512"] and ds.num_samples == 24
    del ds
    shutil.copytree(Path(corpus["plain"], "mds", "beta"), tmp_path / "mds" / "beta")
    stream = str(tmp_path / "mds" / "beta" / "512" / "512x512")
    write_skip_lists(str(tmp_path), "beta", [SkipList("beta", 512, 512, 512, "nsfw", "p2", [0], ["x"], 25,
                                                      index_digest(stream))])
    with pytest.raises(ValueError, match=r"another version of stream beta/512/512x512 \(25 samples"):
        CorpusDataset(str(tmp_path), 512, batch_size=4)
    # same size, but computed for another index.json (a republished stream): refused too
    write_skip_lists(str(tmp_path), "beta", [SkipList("beta", 512, 512, 512, "nsfw", "p2", [0], ["x"], 24, "0" * 64)])
    with pytest.raises(ValueError, match="re-materialize skip_lists for beta"):
        CorpusDataset(str(tmp_path), 512, batch_size=4)


def test_a_stream_whose_skip_lists_never_ran_is_refused(corpus, tmp_path) -> None:
    """Fails closed: a published stream without a completion record (skip_lists never ran, or
    failed) is an error naming the stream, not a stream trained unfiltered."""
    shutil.copytree(Path(corpus["plain"], "mds", "beta"), tmp_path / "mds" / "beta")
    with pytest.raises(MissingManifest, match=r"tier 512 has no corpus manifest .*materialize mds_shards and "
                                              r"skip_lists .*`prx-corpus manifest`"):
        CorpusDataset(str(tmp_path), 512, batch_size=4)
    publish_source_manifest(str(tmp_path), "beta")  # what mds_shards does after publishing
    with pytest.raises(UnfilteredStream, match=r"stream beta/512/512x512 has no skip-list record.*skip_lists for "
                                               r"source 'beta'.*allow_unfiltered=True"):
        CorpusDataset(str(tmp_path), 512, batch_size=4)
    with pytest.warns(UserWarning, match="allow_unfiltered: training on beta/512/512x512 without its filter"):
        ds = CorpusDataset(str(tmp_path), 512, batch_size=4, allow_unfiltered=True)
    assert ds.stream_names == ["beta/512/512x512"] and ds.num_samples == 24
    del ds
    gc.collect()


def test_a_removed_skip_folder_or_list_is_refused(corpus, tmp_path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(corpus["skip"], root)
    shutil.rmtree(root / "skiplists" / "alpha" / "512" / "576x448")  # nothing skipped there: only its record
    with pytest.warns(UserWarning, match="left out"):  # the manifest, not the folders, is what it reads
        CorpusDataset(str(root), 512, sources=MAIN, batch_size=4)
    publish_source_manifest(str(root), "alpha")  # the next publish finds the damage
    with pytest.raises(UnfilteredStream, match="stream alpha/512/576x448 has no skip-list record"):
        CorpusDataset(str(root), 512, sources=MAIN, batch_size=4)
    shutil.copytree(Path(corpus["skip"], "skiplists", "alpha", "512", "576x448"), root / "skiplists" / "alpha" / "512" / "576x448")
    lost = next((root / "skiplists" / "alpha" / "512" / "512x512").glob("*.skip"))
    lost.unlink()  # the record counts its samples: a lost list must not mean "nothing to skip"
    publish_source_manifest(str(root), "alpha")
    with pytest.raises(UnfilteredStream, match=rf"alpha/512/512x512: its record counts skipped samples for "
                                               rf"\['{lost.name.removesuffix('.skip')}'\]"):
        CorpusDataset(str(root), 512, sources=MAIN, batch_size=4)


def test_a_republished_stream_with_nothing_skipped_is_refused_until_skip_lists_rerun(corpus, tmp_path) -> None:
    """The case that used to pass silently: a stream with nothing to skip, republished with new
    samples (which may be duplicates or nsfw) before skip_lists ran again."""
    shutil.copytree(Path(corpus["plain"], "mds", "beta"), tmp_path / "mds" / "beta")
    write_skip_lists(str(tmp_path), "beta", [])
    CorpusDataset(str(tmp_path), 512, batch_size=4)
    index = tmp_path / "mds" / "beta" / "512" / "512x512" / "index.json"
    index.write_text(index.read_text().replace('"version": 2', '"version":  2'))  # republished: another digest
    with pytest.raises(UnfilteredStream, match="re-materialize skip_lists for beta"):
        CorpusDataset(str(tmp_path), 512, batch_size=4)
    write_skip_lists(str(tmp_path), "beta", [])
    assert CorpusDataset(str(tmp_path), 512, batch_size=4).num_samples == 24


def test_substitutes_stay_in_their_shard_spread_evenly_and_rotate_per_epoch() -> None:
    # shards of 5, 4 and 6 samples; shard 1 entirely skipped (falls back to the whole stream)
    skipped = np.array([0, 2, 5, 6, 7, 8, 14], np.int64)
    plan = StreamPlan("s", 512, 512, 512, "x", 15, skipped, "")
    subs, kept = Substitutes(plan.name, plan.count, plan.skipped, [5, 4, 6]), sorted(set(range(15)) - set(skipped.tolist()))
    for epoch in range(3):
        got = {j: subs(j, epoch) for j in skipped.tolist()}
        assert all(v in kept for v in got.values()) and all(subs(k, epoch) == k for k in kept)
        assert {got[0], got[2]} <= {1, 3, 4} and got[0] != got[2]  # same shard, no repeat
        assert got[14] in range(9, 14)
    assert len({subs(5, e) for e in range(8)}) > 1 and len({subs(0, e) for e in range(3)}) == 3


def test_substitute_table_matches_the_formula_in_plain_integers() -> None:
    """The vectorized, modular table and the bitmap lookup against the documented formula."""
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 9, 60).tolist()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    mask = rng.random(starts[-1]) < 0.3
    mask[starts[4]:starts[5]] = True  # one shard entirely skipped
    skipped = np.flatnonzero(mask).astype(np.int64)
    subs = Substitutes("src/512/512x512", int(starts[-1]), skipped, sizes)
    kept = np.flatnonzero(~mask).tolist()
    for epoch in (0, 1, 7, 10**9):
        for pos, j in enumerate(skipped.tolist()):
            shard = int(np.searchsorted(starts, j, "right")) - 1
            a, b = int(starts[shard]), int(starts[shard + 1])
            shard_skipped = [s for s in skipped.tolist() if a <= s < b]
            shard_kept = [k for k in kept if a <= k < b]
            pool, r, s = (shard_kept, shard_skipped.index(j), len(shard_skipped)) if shard_kept else (kept, pos, len(skipped))
            assert subs(np.int64(j), epoch) == pool[(2654435761 * (r + epoch * s) + subs.offset) % len(pool)]


def test_real_substitutes_stay_in_their_shard(corpus) -> None:
    ds = load(corpus["skip"])
    for stream, plan in enumerate(ds.plans):
        start = int(ds.sample_offset_per_stream[stream])
        skipped = set(plan.skipped.tolist())
        for j in skipped:
            sub, shard = ds.substitute(start + j), ds.spanner[start + j][0]
            first = int(ds.sample_offset_per_shard[shard]) - start
            whole_shard_skipped = set(range(first, first + int(ds.samples_per_shard[shard]))) <= skipped
            assert sub - start not in skipped and (whole_shard_skipped or ds.spanner[sub][0] == shard)
    del ds
    gc.collect()


def test_per_stream_batches_have_one_size_with_workers(corpus) -> None:
    ds = load(corpus["skip"])
    loader = StreamingDataLoader(ds, batch_size=4, collate_fn=collate, num_workers=2)
    batches = list(loader)
    assert sum(len(b["sample_id"]) for b in batches) == 120
    for b in batches:
        sizes = {(w, h) for w, h in zip(b["width"], b["height"])} | {im.size for im in b["image"]}
        assert len(sizes) == 1 and not set(b["sample_id"]) & corpus["skipped"]
    del loader, ds
    gc.collect()


def test_resume_from_state_dict_replays_the_rest_of_the_epoch(corpus) -> None:
    def run(state: dict | None = None, stop_after: int | None = None) -> tuple[list, dict | None]:
        ds = load(corpus["skip"])
        loader = StreamingDataLoader(ds, batch_size=4, collate_fn=collate)
        if state:
            loader.load_state_dict(state)
            return [[b["sample_id"] for b in loader]], None
        seen: list[list] = [[b["sample_id"] for b in loader], []]  # epoch 0 whole, then (part of) epoch 1
        for b in loader:
            seen[1].append(b["sample_id"])
            if len(seen[1]) == stop_after:
                return seen, loader.state_dict()
        return seen, None

    reference, _ = run()  # two whole epochs, uninterrupted
    first, state = run(stop_after=7)
    assert state == {**state, "epoch": 1, "sample_in_epoch": 28}
    rest, _ = run(state)
    assert first[0] == reference[0] and len(rest[0]) == 30 - 7 and first[1] + rest[0] == reference[1]


RANK_SCRIPT = """
import gc, json, os, sys, warnings
import torch.distributed as dist
dist.init_process_group("gloo")
from prx_core.shards.loader import CorpusDataset
out = {}
for name, root in (("plain", sys.argv[1]), ("skip", sys.argv[2])):
    class Recording(CorpusDataset):
        planned = []
        def get_item(self, i, retry=7):
            self.planned.append(int(i))
            return super().get_item(i, retry)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = Recording(root, 512, sources=["alpha", "beta"], batch_size=4, shuffle=True, shuffle_seed=5)
    out[name] = {"len": len(ds), "ids": [s["sample_id"] for s in ds],
                 "planned": Recording.planned}
    del ds
    gc.collect()
    dist.barrier()
with open(sys.argv[3] + "." + os.environ["RANK"], "w") as handle:
    json.dump(out, handle)
dist.destroy_process_group()
"""


def test_two_ranks_get_equal_lengths_and_disjoint_partitions(corpus, tmp_path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script, out = tmp_path / "rank.py", tmp_path / "out"
    script.write_text(RANK_SCRIPT)
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(script), corpus["plain"], corpus["skip"], str(out)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=180)[0] for p in procs]  # both: a rank that died explains the other's error
    assert [p.returncode for p in procs] == [0, 0], "\n".join(f"rank {r}: {log[-3000:]}" for r, log in enumerate(logs))
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    every = {i for n, s in corpus["streams"].items() if n.split("/")[0] in MAIN and n != TINY and "/512/" in n
             for i in s.sample_ids}
    plain = (r0["plain"]["ids"], r1["plain"]["ids"])
    assert len(plain[0]) == len(plain[1]) == r0["plain"]["len"] == 60
    assert not set(plain[0]) & set(plain[1]) and set(plain[0]) | set(plain[1]) == every
    planned = (r0["skip"]["planned"], r1["skip"]["planned"])
    assert len(r0["skip"]["ids"]) == len(r1["skip"]["ids"]) == 60
    assert not set(planned[0]) & set(planned[1]) and set(planned[0]) | set(planned[1]) == set(range(120))
    assert not (set(r0["skip"]["ids"]) | set(r1["skip"]["ids"])) & corpus["skipped"]


def test_prx_trainer_style_discovery_reads_the_tree(corpus) -> None:
    """As StreamingProcessedDataset does: each <root>/mds/<source>/<tier> as a local path, its
    immediate subfolders with index.json as streams, stock `jpeg` decoding."""
    streams = []
    for source in ("alpha", "beta", "gamma"):
        tier_dir = Path(corpus["plain"], "mds", source, "512")
        streams += [Stream(local=str(p)) for p in sorted(tier_dir.iterdir()) if (p / "index.json").is_file()]
    ds = StreamingDataset(streams=streams, batch_size=1, shuffle=False, batching_method="per_stream")
    by_id = {r["sample_id"]: r for rows in corpus["rows"].values() for r in rows if r["tier"] == 512}
    samples = list(ds)
    del ds
    gc.collect()
    assert sorted(s["sample_id"] for s in samples) == sorted(by_id)
    same = ("caption", "original_caption", "width", "height", "original_width", "original_height", "source")
    for s in samples:
        row = by_id[s["sample_id"]]
        assert s["image"].format == "JPEG" and s["image"].fp.getvalue() == row["jpeg"]
        assert s["image"].size == (s["width"], s["height"]) and all(s[k] == row[k] for k in same)


def test_proportions_split_over_a_source_streams_by_sample_count(corpus) -> None:
    ds = load(corpus["plain"], proportions={"alpha": 1.0, "beta": 3.0}, epoch_size=240)
    got = {n: round(float(s.proportion), 4) for n, s in zip(ds.stream_names, ds.streams)}
    del ds
    gc.collect()
    alpha = 40 + 32 + 24  # the tiny stream is left out before the split
    assert got == {"alpha/512/448x576": round(0.25 * 24 / alpha, 4), "alpha/512/512x512": round(0.25 * 40 / alpha, 4),
                   "alpha/512/576x448": round(0.25 * 32 / alpha, 4), "beta/512/512x512": 0.75}
    with pytest.raises(ValueError, match="no weight for sources"):
        CorpusDataset(corpus["plain"], 512, sources=MAIN, proportions={"alpha": 1.0})


def test_s3_root_reads_the_same_sequence(corpus, s3_endpoint, tmp_path, monkeypatch) -> None:
    options = s3_endpoint["storage_options"]
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="loader")
    root = "s3://loader/corpus"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mds, "SIZE_LIMIT", 150_000)
        for source in MAIN:
            summaries = publish.write_source_streams(corpus["rows"][source], root, source, options)
            write_skip_lists(root, source, skip_lists(source, summaries, options), options)
    monkeypatch.delenv("S3_ENDPOINT_URL", raising=False)
    remote = epochs(load(root, storage_options=options, cache_dir=str(tmp_path / "cache")))
    assert os.environ["S3_ENDPOINT_URL"] == s3_endpoint["endpoint"]
    assert remote == epochs(load(corpus["skip"]))
    assert any(tmp_path.joinpath("cache", "alpha", "512", "512x512").rglob("shard.00000.mds"))


def test_loader_benchmark_smoke_run() -> None:
    """`prx-bench loader`'s code path on a tiny corpus (a smoke run, not a timing assertion)."""
    from benchmarks.loader import format_table, run

    r = run(samples=300, decode_samples=64, repeats=1)
    assert r["streams"] == 10 and abs(r["skipped_fraction"] - 0.1) < 0.01 and r["decode_samples_per_run"] == 64
    for kind in ("stock", "plain", "skip10"):
        assert r[f"{kind}_read_cpu_sps"] > 0 and r[f"{kind}_decode_sps"] > 0
    assert "target < 5%" in format_table(r) and 0 < r["substitute_us_kept"] < 100
