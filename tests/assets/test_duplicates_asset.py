"""`phashes` per source and the global `duplicates`: planted groups found, one keeper each."""

from __future__ import annotations

import pytest
from conftest import SOURCES, Corpus, Manifest, by


@pytest.mark.parametrize("source", SOURCES)
def test_every_sample_is_hashed(corpus: Corpus, source: str) -> None:
    samples = by(corpus.rows("samples", ["sample_id", "width", "height"], f"source = '{source}'"), "sample_id")
    hashes = by(corpus.rows("phashes", filter=f"source = '{source}'"), "sample_id")
    assert set(hashes) == set(samples)
    for sid, row in hashes.items():
        assert (row["width"], row["height"]) == (samples[sid]["width"], samples[sid]["height"])
        assert row["pixels"] == row["width"] * row["height"]
    meta = corpus.metadata("phashes", source)
    assert meta["rows"] == len(hashes) and meta["failed"] == 0 and meta["images_per_second"] > 0
    assert not corpus.rows("rejects", filter=f"source = '{source}' AND stage = 'phashes'")


def duplicate_groups(corpus: Corpus) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    rows = corpus.rows("duplicates")
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group_id"], []).append(row)
    return by(rows, "sample_id"), groups


def test_planted_groups_are_found_with_the_original_kept(corpus: Corpus, manifest: Manifest,
                                                         record_property) -> None:
    """Every original is grouped with its same-size twin (byte copy or re-encode) and kept; its
    half-size copy, when its pHash matches, loses to it."""
    member, groups = duplicate_groups(corpus)
    planted = manifest.groups()
    assert len(planted) == 10
    resize_matched = 0
    for name, roles in sorted(planted.items()):
        original = roles["original"].sample_id
        twin = (roles.get("copy") or roles["reencode"]).sample_id
        assert original in member and twin in member, (name, original, twin)
        assert member[original]["group_id"] == member[twin]["group_id"], name
        assert member[original]["keeper"] and not member[twin]["keeper"], name
        assert member[twin]["keeper_sample_id"] == original
        half = roles["resize50"].sample_id
        if half in member and member[half]["group_id"] == member[original]["group_id"]:
            resize_matched += 1
            assert not member[half]["keeper"] and member[half]["keeper_sample_id"] == original
    record_property("resize50_matched", resize_matched)
    print(f"resize50 copies grouped with their original: {resize_matched}/10")
    assert resize_matched >= 5, "half-size copies should mostly share the original's pHash"


def test_keeper_is_the_highest_resolution_then_quality_bytes_and_sample_id(corpus: Corpus) -> None:
    member, groups = duplicate_groups(corpus)
    hashes = by(corpus.rows("phashes"), "sample_id")

    def order(row: dict) -> tuple:
        facts = hashes[row["sample_id"]]
        quality = 100 if facts["jpeg_quality"] is None else facts["jpeg_quality"]
        return (-row["pixels"], -quality, -facts["num_bytes"], row["sample_id"])

    assert groups
    for group_id, rows in groups.items():
        assert len(rows) >= 2
        keepers = [r for r in rows if r["keeper"]]
        assert len(keepers) == 1, group_id
        best = min(rows, key=order)
        assert keepers[0]["sample_id"] == best["sample_id"], rows
        assert {r["keeper_sample_id"] for r in rows} == {best["sample_id"]}
        assert {r["group_size"] for r in rows} == {len(rows)}
    # on equal pixels the q95 original beats the q80 re-encode, and the byte copy loses on sample_id
    ties = [rows for rows in groups.values() if len({r["pixels"] for r in rows}) < len(rows)]
    assert ties and all(next(r for r in rows if r["keeper"])["sample_id"].startswith("stock_photos/") for rows in ties)


def test_groups_are_identical_phashes_across_sources(corpus: Corpus) -> None:
    member, groups = duplicate_groups(corpus)
    hashes = by(corpus.rows("phashes"), "sample_id")
    for group_id, rows in groups.items():
        assert {hashes[r["sample_id"]]["phash"] for r in rows} == {int(group_id, 16)}
    by_hash: dict[int, list[str]] = {}
    for sid, row in hashes.items():
        by_hash.setdefault(row["phash"], []).append(sid)
    expected = {sid for ids in by_hash.values() if len(ids) > 1 for sid in ids}
    assert set(member) == expected
    assert len({r["source"] for r in member.values()}) == 3


def test_duplicates_check_and_metadata(corpus: Corpus) -> None:
    assert corpus.checks[("duplicates_one_keeper", None)].passed
    member, groups = duplicate_groups(corpus)
    meta = corpus.metadata("duplicates", None)
    assert meta["groups"] == len(groups)
    assert meta["duplicates"] == len(member) - len(groups)
    assert meta["ops"]["hashes_read"] == sum(corpus.metadata("phashes", s)["rows"] for s in SOURCES)
    assert meta["duplicate_rate"] == pytest.approx(meta["duplicates"] / meta["ops"]["hashes_read"], abs=1e-4)
