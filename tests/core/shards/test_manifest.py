"""The per-tier corpus manifest: written by the publishers, read once per node by the loader.

Real MDS streams (tiny JPEGs) and real skip-lists; concurrency with real processes; the S3 case
against a real S3 HTTP endpoint on loopback.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
from pathlib import Path

import boto3
import numpy as np
import pytest
from PIL import Image

from prx_core.image.imaging import encode_jpeg
from prx_core.shards.loader import CorpusDataset
from prx_core.shards.manifest import CURRENT, Manifest, MissingManifest, current_name, load_manifest
from prx_core.shards.manifest_publish import assemble_tier, list_plans, publish_manifests, publish_source_manifest
from prx_core.shards.mds.publish import write_source_streams
from prx_core.shards.mds.retention import RETENTION_SECONDS
from prx_core.shards.skiplists.files import SkipList, index_digest
from prx_core.shards.skiplists.publish import write_skip_lists

BUCKETS = [(512, 64, 64, 12), (512, 80, 48, 9), (1024, 64, 64, 5)]  # (tier, w, h, samples)


def rows(source: str, scale: int = 1) -> list[dict]:
    out = []
    for tier, w, h, count in BUCKETS:
        for i in range(count * scale):
            jpeg = encode_jpeg(Image.new("RGB", (w, h), ((i * 37) % 255, len(source) * 20, tier % 255)))
            out.append({"tier": tier, "bucket_width": w, "bucket_height": h, "width": w, "height": h, "jpeg": jpeg,
                        "caption": f"{source} {i}", "original_caption": "", "original_width": w,
                        "original_height": h, "sample_id": f"{source}/{tier}-{w}-{i}", "source": source})
    return out


def publish(root: str, source: str, skips: dict[tuple[int, int, int], list[int]], options: dict | None = None,
            scale: int = 1) -> None:
    """What mds_shards then skip_lists do for one source."""
    summaries = write_source_streams(rows(source, scale), root, source, options)
    lists = [SkipList(source, s.tier, s.width, s.height, "duplicate", "p1", skips[(s.tier, s.width, s.height)],
                      [s.sample_ids[i] for i in skips[(s.tier, s.width, s.height)]], s.count,
                      index_digest(s.uri, options))
             for s in summaries if skips.get((s.tier, s.width, s.height))]
    write_skip_lists(root, source, lists, options)


SKIPS = {"alpha": {(512, 64, 64): [0, 5, 11], (1024, 64, 64): [2]}, "beta": {(512, 80, 48): [1, 2]}}


@pytest.fixture()
def corpus(tmp_path: Path) -> str:
    root = str(tmp_path / "corpus")
    for source in ("alpha", "beta"):
        publish(root, source, SKIPS[source])
    return root


def test_manifest_round_trip_matches_the_folders_and_is_content_named(corpus: str) -> None:
    for tier in (512, 1024):
        manifest = load_manifest(corpus, tier)
        plans, refused = list_plans(corpus, tier, None)
        assert not refused and not manifest.refused
        got = manifest.plans()
        assert [p.name for p in got] == [p.name for p in plans]
        for a, b in zip(got, plans):
            assert (a.uri, a.count, a.index_digest, a.shards_digest, a.reasons) == \
                   (b.uri, b.count, b.index_digest, b.shards_digest, b.reasons)
            assert a.skipped.tolist() == b.skipped.tolist()
        assert isinstance(manifest.positions, np.memmap)  # mapped, not read into each process
    assert [p.skipped.tolist() for p in load_manifest(corpus, 512).plans(["alpha"])] == [[0, 5, 11], []]
    pointer = json.loads(Path(corpus, "manifests", "512", CURRENT).read_text())
    assert pointer == {"manifest": current_name(corpus, 512), "streams": 4, "samples": 42, "skipped": 5, "refused": 0}
    before = sorted(p.name for p in Path(corpus, "manifests").rglob("*"))
    assert publish_manifests(corpus) == {s: {512: current_name(corpus, 512), 1024: current_name(corpus, 1024)}
                                         for s in ("alpha", "beta")}
    assert sorted(p.name for p in Path(corpus, "manifests").rglob("*")) == before  # idempotent: same bytes, same name


def test_a_republished_stream_is_refused_until_its_skip_lists_rerun(corpus: str) -> None:
    first = current_name(corpus, 512)
    write_source_streams(rows("beta", scale=2), corpus, "beta")  # mds_shards republishes: more samples
    manifest = load_manifest(corpus, 512)
    assert manifest.name != first
    assert sorted(manifest.refused) == ["beta/512/64x64", "beta/512/80x48"]
    assert "re-materialize skip_lists for beta" in manifest.refused["beta/512/80x48"]
    assert [p.name for p in manifest.plans()] == ["alpha/512/64x64", "alpha/512/80x48"]
    with pytest.raises(ValueError, match=r"skip-lists of beta/512/64x64 .*another version.* \(1 more streams refused\)"):
        CorpusDataset(corpus, 512, batch_size=2)
    CorpusDataset(corpus, 512, sources=["alpha"], batch_size=2)  # another source's refusal is not this one's
    with pytest.warns(UserWarning, match="allow_unfiltered: training on beta/512/"), \
            pytest.raises(ValueError, match=r"80x48/duplicate.skip was computed for another version"):
        CorpusDataset(corpus, 512, batch_size=2, allow_unfiltered=True)  # wrong skips: refused even then
    write_skip_lists(corpus, "beta", [])
    assert not load_manifest(corpus, 512).refused
    assert CorpusDataset(corpus, 512, batch_size=2).num_samples == 12 + 9 + 24 + 18


def test_a_pinned_manifest_reads_until_pruned_a_retention_later(corpus: str) -> None:
    pinned = current_name(corpus, 512)
    publish(corpus, "beta", {(512, 80, 48): [0]})
    assert current_name(corpus, 512) != pinned
    old = CorpusDataset(corpus, 512, sources=["beta"], batch_size=2, manifest=pinned, allow_unfiltered=False)
    assert old.manifest_name == pinned
    assert [p.skipped.tolist() for p in old.plans] == [[], [1, 2]]  # the skips as that manifest had them
    del old
    later = os.path.getmtime(Path(corpus, "manifests", "512", "superseded.json")) + RETENTION_SECONDS + 1
    assemble_tier(corpus, 512, now=later)
    assert not Path(corpus, "manifests", "512", pinned).exists()
    with pytest.raises(MissingManifest, match="pruned after its retention"):
        load_manifest(corpus, 512, pinned)
    Path(corpus, "manifests", "512", CURRENT).unlink()
    with pytest.raises(MissingManifest, match=r"tier 512 has no corpus manifest .*`prx-corpus manifest`"):
        CorpusDataset(corpus, 512, batch_size=2)


def _publish_again(root: str, source: str, times: int) -> None:
    for i in range(times):
        write_skip_lists(root, source, [])  # rewrites the part, then assembles the shared manifest
        if i % 2:
            os.sched_yield()


def test_sources_publishing_at_once_all_end_in_the_manifest(tmp_path: Path) -> None:
    root = str(tmp_path / "corpus")
    sources = ["s0", "s1", "s2", "s3"]
    for source in sources:
        write_source_streams(rows(source), root, source)  # parts with refused streams
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_publish_again, args=(root, s, 3)) for s in sources]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    manifest = load_manifest(root, 512)
    assert not manifest.refused  # every source's last part (nothing refused) made it in
    assert sorted(manifest.header["sources"]) == sources
    assert assemble_tier(root, 512) == manifest.name  # the current one is the assembly of the current parts


def _map_on_a_rank(root: str, options: dict, cache: str) -> tuple[str, int, bool, int]:
    manifest = load_manifest(root, 512, None, options, cache)
    with open("/proc/self/maps") as maps:
        mapped = any(manifest.path in line for line in maps)
    return manifest.path, os.stat(manifest.path).st_ino, mapped, int(manifest.positions.sum())


def test_a_nodes_ranks_share_one_mapped_copy_of_a_remote_manifest(tmp_path: Path, s3_endpoint: dict) -> None:
    options = s3_endpoint["storage_options"]
    boto3.client("s3", endpoint_url=s3_endpoint["endpoint"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="manifests")
    root = "s3://manifests/corpus"
    for source in ("alpha", "beta"):
        publish(root, source, SKIPS[source], options)
    cache = str(tmp_path / "node-cache")
    with multiprocessing.get_context("fork").Pool(4) as ranks:
        seen = ranks.starmap(_map_on_a_rank, [(root, options, cache)] * 4)
    assert len({(path, inode) for path, inode, _, _ in seen}) == 1  # one copy per node
    assert all(mapped for _, _, mapped, _ in seen) and {s for *_, s in seen} == {0 + 5 + 11 + 1 + 2}
    assert sorted(p.name for p in Path(cache, "manifests").iterdir()) == sorted(
        [current_name(root, 512, options), f"{current_name(root, 512, options)}.lock"])


def test_datasets_pickle_without_their_skip_positions(corpus: str) -> None:
    """A spawned dataloader worker maps the manifest again rather than receiving a copy of it."""
    manifest = load_manifest(corpus, 512)
    again = pickle.loads(pickle.dumps(manifest))
    assert isinstance(again, Manifest) and isinstance(again.positions, np.memmap)
    assert again.positions.tolist() == manifest.positions.tolist()
    assert b"positions" not in pickle.dumps(manifest)
    dataset = CorpusDataset(corpus, 512, batch_size=2, shuffle=False)
    copy = pickle.loads(pickle.dumps(dataset))
    assert [copy.substitute(i) for i in range(dataset.num_samples)] == \
           [dataset.substitute(i) for i in range(dataset.num_samples)]
    assert all(p.skipped.base is not None for p in copy.plans)  # views of the mapped file again


def test_a_part_written_during_an_assembly_is_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race, made to happen: while alpha's run assembles the tier (parts read, manifest not
    yet current), beta's run writes its part and makes its own manifest current; alpha's pointer
    then lands last, without beta's new part, so alpha must see the change and assemble again."""
    import prx_core.shards.manifest_publish as mp

    root = str(tmp_path / "corpus")
    for source in ("alpha", "beta"):
        write_source_streams(rows(source), root, source)
    encode_head, assemblies = mp.encode_head, []

    def interleaved(tier, entries, refused, extra=None):
        if tier == 512:  # an assembly: alpha's parts read, nothing current yet
            assemblies.append(sorted(extra["sources"]))
            if len(assemblies) == 1:
                monkeypatch.setattr(mp, "encode_head", encode_head)
                write_skip_lists(root, "beta", [])  # beta's whole run, inside alpha's assembly
                monkeypatch.setattr(mp, "encode_head", interleaved)
        return encode_head(tier, entries, refused, extra)

    monkeypatch.setattr(mp, "encode_head", interleaved)
    write_skip_lists(root, "alpha", [])
    manifest = load_manifest(root, 512)
    assert not manifest.refused, manifest.refused  # beta's records made it, though alpha's pointer came last
    assert len(assemblies) == 2  # alpha assembled again after seeing beta's part change
    assert assemble_tier(root, 512) == manifest.name


def _rank_resolves(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from prx_core.shards.batching import broadcast_from_rank0

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    got = broadcast_from_rank0(lambda: f"m-seen-by-rank-{rank}.prxm")
    try:
        broadcast_from_rank0(lambda: (_ for _ in ()).throw(MissingManifest(f"no manifest (rank {rank})")))
        failed = ""
    except MissingManifest as exc:
        failed = str(exc)
    Path(out, f"{rank}.json").write_text(json.dumps([got, failed]))
    dist.destroy_process_group()


def test_every_rank_reads_the_manifest_rank_0_resolved(tmp_path: Path) -> None:
    """Under torch.distributed, rank 0 resolves `current.json` and every rank gets its answer (a
    publish between two ranks' start must not give them different manifests), its error too."""
    ctx = multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=_rank_resolves, args=(r, str(tmp_path / "store"), str(tmp_path))) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(180)
        assert p.exitcode == 0
    for r in (0, 1):
        assert json.loads((tmp_path / f"{r}.json").read_text()) == ["m-seen-by-rank-0.prxm", "no manifest (rank 0)"]


def test_compaction_prunes_superseded_manifests_and_keeps_the_current_one(corpus: str) -> None:
    from prx_core.shards.manifest_publish import prune_tier_manifests

    first = current_name(corpus, 512)
    publish(corpus, "beta", {(512, 80, 48): [0]})
    leftover = Path(corpus, "manifests", "512", ".assembling-crashed.prxm")  # a crashed assembler's temporary
    leftover.write_bytes(b"partial")
    assert prune_tier_manifests(corpus, retention_seconds=3600) == []  # all superseded within the hour
    later = os.path.getmtime(Path(corpus, "manifests", "512", "superseded.json")) + 7200
    removed = prune_tier_manifests(corpus, retention_seconds=3600, now=later)
    assert {first, leftover.name} <= {Path(r).name for r in removed}  # and the fixture's earlier ones
    names = {p.name for p in Path(corpus, "manifests", "512").glob("*.prxm")} | \
            {p.name for p in Path(corpus, "manifests", "512").glob(".*.prxm")}
    assert names == {current_name(corpus, 512)}
    assert CorpusDataset(corpus, 512, batch_size=2).manifest_name == current_name(corpus, 512)
