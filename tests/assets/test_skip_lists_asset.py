"""`skip_lists`: per stream and reason, what training skips; a policy change rewrites only them."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest
from demo_corpus import Corpus, SOURCES, caption_keys_by_sample, copy_corpus, read, stream_dirs, tree_digest
from materializing import fresh_instance, materialize, materialized, resources_for

from prx_core.shards.skiplists.files import read_skip_lists, skipped_indices
from prx_core.stages.skip_lists.stage import SkipPolicy


def expected_skips(root: Path, source: str, policy: SkipPolicy) -> dict[tuple[int, str, str], dict[int, str]]:
    """(tier, bucket, reason) -> {stream index: sample_id}, derived from the tables directly."""
    index = read(root, "mds_index", filter=f"source = '{source}'").to_pylist()
    reasons: dict[str, set[str]] = defaultdict(set)
    if policy.duplicates:
        reasons["duplicate"] = {r["sample_id"] for r in read(root, "duplicates").to_pylist()
                                if r["source"] == source and not r["keeper"]}
    labels = {r["content_id"]: r["label"] for r in read(root, "caption_labels").to_pylist()}
    keys = caption_keys_by_sample(root, source)
    for row in index:
        label = labels.get(keys[row["sample_id"]])
        if label in policy.labels:
            reasons[label].add(row["sample_id"])
        key = row["sample_id"].split("/", 1)[1]
        if row["sample_id"] in policy.opt_out or key in policy.opt_out:
            reasons["opt_out"].add(row["sample_id"])
    out: dict[tuple[int, str, str], dict[int, str]] = defaultdict(dict)
    for row in index:
        for reason, ids in reasons.items():
            if row["sample_id"] in ids:
                out[(row["tier"], row["bucket"], reason)][row["index"]] = row["sample_id"]
    return dict(out)


def actual_skips(root: Path, source: str) -> dict[tuple[int, str, str], dict[int, str]]:
    return {(s.tier, f"{s.width}x{s.height}", s.reason): dict(zip(s.indices, s.sample_ids))
            for s in read_skip_lists(str(root), source)}


@pytest.mark.parametrize("source", SOURCES)
def test_duplicates_and_text_are_skip_listed_at_their_stream_index(corpus: Corpus, source: str) -> None:
    policy = SkipPolicy()
    expected = expected_skips(corpus.root, source, policy)
    assert {reason for _, _, reason in expected} >= {"text"}
    if source in ("web_images", "crawl_wds"):  # they hold copies of stock_photos' originals (the keepers)
        assert any(reason == "duplicate" for _, _, reason in expected)
    assert actual_skips(corpus.root, source) == expected
    sizes = {(r["tier"], r["bucket"]): 0 for r in corpus.rows("mds_index", filter=f"source = '{source}'")}
    for r in corpus.rows("mds_index", filter=f"source = '{source}'"):
        sizes[(r["tier"], r["bucket"])] += 1
    for skip in read_skip_lists(str(corpus.root), source):
        assert skip.policy_version == policy.version()
        assert skip.stream_size == sizes[(skip.tier, f"{skip.width}x{skip.height}")]


def test_every_non_keeper_duplicate_and_text_sample_is_skipped(corpus: Corpus) -> None:
    """Across the corpus: each losing duplicate that reached a stream is skipped; no keeper is."""
    index = {r["sample_id"]: r for r in corpus.rows("mds_index")}
    skips = read_skip_lists(str(corpus.root))
    skipped = {(s.source, s.tier, f"{s.width}x{s.height}", i) for s in skips if s.reason == "duplicate" for i in s.indices}
    for dup in corpus.rows("duplicates"):
        row = index.get(dup["sample_id"])
        if row is None:
            continue
        position = (row["source"], row["tier"], row["bucket"], row["index"])
        assert (position in skipped) == (not dup["keeper"]), dup
    labels = corpus.labels()
    text = [r for r in index.values() if labels[r["sample_id"]] == "text"]
    assert len(text) >= 12  # the planted text-heavy samples at least
    skipped_text = {(s.source, s.tier, f"{s.width}x{s.height}", i) for s in skips if s.reason == "text" for i in s.indices}
    assert all((r["source"], r["tier"], r["bucket"], r["index"]) in skipped_text for r in text)


@pytest.mark.parametrize("source", SOURCES)
def test_skip_lists_metadata_and_fraction_check(corpus: Corpus, source: str) -> None:
    meta = corpus.metadata("skip_lists", source)
    lists = read_skip_lists(str(corpus.root), source)
    assert meta["policy_version"] == SkipPolicy().version()
    assert meta["files"] == len(lists)
    union: dict[str, set[int]] = defaultdict(set)
    for folder in stream_dirs(corpus.root, source):
        w, h = (int(v) for v in folder.name.split("x"))
        union[f"{folder.parent.name}/{folder.name}"] = skipped_indices(str(corpus.root), source, int(folder.parent.name), w, h)
    assert meta["skipped"] == sum(len(v) for v in union.values())
    assert meta["samples"] == len(corpus.rows("mds_index", ["sample_id"], f"source = '{source}'"))
    sizes: dict[str, int] = defaultdict(int)
    for r in corpus.rows("mds_index", ["tier", "bucket"], f"source = '{source}'"):
        sizes[f"{r['tier']}/{r['bucket']}"] += 1
    heavy = sorted(s for s, ids in union.items() if len(ids) / sizes[s] > 0.10)
    check = corpus.checks[("skip_lists_fraction", source)]
    assert check.severity.value == "WARN"
    assert check.passed == (not heavy)
    assert sorted(ast.literal_eval(check.metadata["streams_above"].value)) == heavy


def test_policy_change_rewrites_only_the_skip_lists(corpus: Corpus, tmp_path: Path) -> None:
    """labels: [] removes every text list; opt-outs (by sample_id or source_key) appear; shards
    and tables stay as they were."""
    root = copy_corpus(corpus, tmp_path / "corpus")
    opt_out = ["crawl_wds/crawl_00040", "batch_01/img_00060"]
    policy = SkipPolicy(labels=(), opt_out=tuple(opt_out))
    config = {"skip_policy": {"labels": [], "opt_out": opt_out}}
    resources = resources_for(corpus, root, config)
    assert resources["policy"].policy() == policy
    mds_before = tree_digest(root / "mds")
    lance_before = tree_digest(root / "lance")
    assert any(s.reason == "text" for s in read_skip_lists(str(root)))
    instance = fresh_instance(corpus.catalog)
    for source in SOURCES:
        result = materialize(resources, ["skip_lists"], source, instance)
        assert result.success
        assert materialized(result)["skip_lists"]["policy_version"] == policy.version() != SkipPolicy().version()
        assert actual_skips(root, source) == expected_skips(root, source, policy)
    lists = read_skip_lists(str(root))
    assert not [s for s in lists if s.reason == "text"]
    assert not list((root / "skiplists").rglob("text.skip"))
    assert {s.policy_version for s in lists} == {policy.version()}
    opted = {sid for s in lists if s.reason == "opt_out" for sid in s.sample_ids}
    index_ids = {r["sample_id"] for r in read(root, "mds_index", ["sample_id"]).to_pylist()}
    assert opted == {sid for sid in ("crawl_wds/crawl_00040", "web_images/batch_01/img_00060") if sid in index_ids}
    assert opted, "pick opt-out samples that reached a stream"
    assert tree_digest(root / "mds") == mds_before
    assert tree_digest(root / "lance") == lance_before
