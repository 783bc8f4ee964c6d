"""The explorer's rows of a unit: every table joined by key at its pinned version, skip reasons from
the streams' files, and facet counts that stay small however many values a unit holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prx_core.shards.skiplists.files import SkipList, encode, skiplist_uri
from prx_core.stages.explorer.rows import SAMPLE_COLUMNS, count_facets, explore_rows, facet_rows, search_text
from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage

IDS = [f"s/{i:02d}" for i in range(6)]


def write(storage: Storage, table: str, rows: list[dict]) -> int:
    lance_io.overwrite(storage.lance_uri(table), pa.Table.from_pylist(rows, schema=schemas.TABLES[table]))
    return lance_io.table_version(storage.lance_uri(table), None)


def base(rows: int = 6) -> pa.Table:
    table = pa.table({"sample_id": IDS[:rows], "content_id": [f"c{i}" for i in range(rows)], "source": ["s"] * rows,
                      "source_key": [i[2:] for i in IDS[:rows]], "width": [640] * rows, "height": [480] * rows,
                      "format": ["JPEG"] * rows, "jpeg_quality": [90] * rows, "num_bytes": [1000] * rows,
                      "original_caption": [f"photo {i}" for i in range(rows)]})
    table = table.cast(pa.schema([schemas.SAMPLES.field(c) for c in SAMPLE_COLUMNS]))
    return table.append_column("stored", pa.array([True] * rows)).append_column("meta_label", pa.nulls(rows, pa.string()))


@pytest.fixture
def tables(tmp_path: Path) -> tuple[Storage, dict[str, int | None]]:
    storage = Storage(str(tmp_path / "root"))
    inputs: dict[str, int | None] = {"phashes": None}  # never written: its columns stay null
    inputs["rejects"] = write(storage, "rejects", [  # two rejects of one sample: the first is shown, once
        {"sample_id": IDS[1], "source": "s", "stage": "buckets", "reason": "too_small", "message": "a"},
        {"sample_id": IDS[1], "source": "s", "stage": "mds_shards", "reason": "undecodable", "message": "b"}])
    inputs["buckets"] = write(storage, "buckets", [{"sample_id": s, "source": "s", "tier": 512, "bucket": "576x448"}
                                                   for s in IDS])
    inputs["duplicates"] = write(storage, "duplicates", [
        {"sample_id": s, "source": "s", "group_id": "ab", "group_size": 2, "keeper": s == IDS[2],
         "keeper_sample_id": IDS[2]} for s in IDS[2:4]])
    inputs["captions"] = write(storage, "captions", [  # two versions: only the shipped one is joined
        *({"content_id": f"c{i}", "captioner_version": "v1", "caption": f"old {i}"} for i in range(6)),
        *({"content_id": f"c{i}", "captioner_version": "v2", "caption": f"new {i}", "word_count": 2} for i in range(5))])
    inputs["caption_labels"] = write(storage, "caption_labels", [
        {"content_id": "c0", "captioner_version": "v2", "labeler_version": "l1", "label": "photo", "score": 0.5},
        {"content_id": "c0", "captioner_version": "v1", "labeler_version": "l1", "label": "text", "score": 0.9}])
    inputs["mds_index"] = write(storage, "mds_index", [{"sample_id": s, "source": "s", "tier": 512, "bucket": "576x448",
                                                        "index": i} for i, s in enumerate(IDS[:5])])
    skip = SkipList("s", 512, 576, 448, "duplicate", "p", [3], [IDS[3]], 5)
    for reason, indices in (("duplicate", [3]), ("text", [0, 3])):
        path = Path(skiplist_uri(storage.root, "s", 512, 576, 448, reason))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode({**skip.header(), "reason": reason, "count": len(indices)}, np.asarray(indices, np.int64)))
    return storage, inputs


def test_rows_join_every_table_at_the_shipped_versions(tables) -> None:
    storage, inputs = tables
    rows = explore_rows(storage, inputs, base(), {"captioner_version": "v2", "labeler_version": "l1"})
    assert rows.schema == schemas.EXPLORER and rows["sample_id"].to_pylist() == IDS  # the unit's order, one row each
    by = {r["sample_id"]: r for r in rows.to_pylist()}
    assert (by[IDS[1]]["reject_reason"], by[IDS[1]]["reject_stage"]) == ("too_small", "buckets")
    assert by[IDS[0]]["caption"] == "new 0" and by[IDS[0]]["captioner_version"] == "v2"
    assert by[IDS[5]]["caption"] is None and by[IDS[5]]["captioner_version"] is None  # not captioned by v2
    assert (by[IDS[0]]["label"], by[IDS[0]]["score"]) == ("photo", 0.5)
    assert [by[s]["keeper"] for s in IDS[2:4]] == [True, False] and by[IDS[0]]["group_id"] is None
    assert [by[s]["mds_index"] for s in IDS] == [0, 1, 2, 3, 4, None]
    assert [by[s]["skip_reason"] for s in IDS] == ["text", None, None, "duplicate,text", None, None]
    assert all(r["phash"] is None and r["tier"] == 512 for r in by.values())
    assert by[IDS[0]]["search_text"] == f"new 0 {by[IDS[0]]['original_caption']}".strip()  # what the search reads


@pytest.mark.parametrize(("caption", "original", "expected"), [
    ("a red car", "car.jpg", "a red car car.jpg"), (None, "alt text", "alt text"), ("a cat", None, "a cat"),
    (None, None, None), ("", "", None), (" spaced ", None, "spaced")])
def test_search_text_joins_both_captions_and_is_null_without_text(caption, original, expected) -> None:
    joined = search_text(pa.chunked_array([[caption, "x"]], pa.string()), pa.chunked_array([[original, "y"]], pa.string()))
    assert joined.to_pylist() == [expected, "x y"]  # one row per row, whatever is null


def test_facets_count_rows_and_keep_only_the_top_values() -> None:
    n = 500
    rows = pa.table({"label": [f"l{i % 300}" for i in range(n)], "tier": [512] * n, "bucket": ["576x448"] * n,
                     "skip_reason": ["a,b" if i % 2 else None for i in range(n)], "reject_reason": [None] * n,
                     "meta_label": [None] * n, "group_id": [f"g{i}" for i in range(n)],
                     "group_size": list(range(n)), "width": [640] * n, "height": [480] * n,
                     "stored": [True] * n, "mds_index": list(range(n)), "caption": ["x"] * n,
                     "keeper": [i % 3 == 0 for i in range(n)], "sample_id": [f"s/{i:03d}" for i in range(n)],
                     "word_count": [(i * 37) % n for i in range(n)], "caption_repetition": [i / n for i in range(n)],
                     "caption_attempts": [2 if i % 50 == 0 else 1 for i in range(n)],
                     "caption_verdict": ["rejected" if i % 100 == 0 else "ok" for i in range(n)],
                     "caption_problem": ["repetition" if i % 50 == 0 else None for i in range(n)]},
                    schema=pa.schema([schemas.EXPLORER.field(c) for c in (
                        "label", "tier", "bucket", "skip_reason", "reject_reason", "meta_label", "group_id",
                        "group_size", "width", "height", "stored", "mds_index", "caption", "keeper", "sample_id",
                        "word_count", "caption_repetition", "caption_attempts", "caption_verdict", "caption_problem")]))
    counts = count_facets(rows, top=50)
    assert counts["caption"] == {"repetition": 10}
    assert counts["totals"]["caption_rejected"] == 5 and counts["totals"]["captioned"] == n - 5
    assert list(counts["worst_shortest"].values())[:3] == [0, 1, 2] and len(counts["worst_shortest"]) == 100
    assert list(counts["worst_longest"].values())[0] == n - 1
    assert list(counts["worst_repetitive"])[0] == f"s/{n - 1:03d}"  # the highest score first
    assert counts["worst_retried"] == {f"s/{i:03d}": 2 for i in range(0, n, 50)}
    assert len(counts["label"]) == 50 and counts["label"]["l0"] == 2  # 300 labels: the 50 most frequent
    assert list(counts["group"]) == [f"g{i}" for i in range(n - 1, n - 51, -1)]  # the largest groups
    assert counts["skipped"] == {"a": n // 2, "b": n // 2} and counts["tier"] == {"512": n}
    assert sum(counts["side"].values()) == sum(counts["aspect"].values()) == n
    assert [int(k) for k in counts["side"]] == [int(8 * 0.5 * np.log2(640 * 480))]
    assert counts["totals"]["duplicates"] == sum(i % 3 != 0 for i in range(n)) and counts["totals"]["rows"] == n
    facets = facet_rows("s", counts)
    assert facets.schema == schemas.EXPLORER_FACETS and facets.num_rows == sum(
        bool(n) or facet in ("totals", "worst_shortest") for facet, v in counts.items() for n in v.values())


def test_summed_unit_facets_keep_the_top_values_every_bin_and_every_total() -> None:
    """Units count their own top values; the partition's sum would otherwise grow with its units."""
    from collections import Counter

    from prx_core.stages.explorer.rows import FACET_VALUES

    units = 5
    summed = {"group": Counter({f"g{u}-{i}": 2 + (i == 0) for u in range(units) for i in range(FACET_VALUES)}),
              "side": Counter({str(b): 1 for b in range(FACET_VALUES + 7)}),
              "totals": Counter({"rows": 10, "duplicates": 0})}
    facets = facet_rows("s", summed).to_pylist()
    groups = [f for f in facets if f["facet"] == "group"]
    assert len(groups) == FACET_VALUES and {f"g{u}-0" for u in range(units)} <= {g["value"] for g in groups}
    assert len([f for f in facets if f["facet"] == "side"]) == FACET_VALUES + 7
    assert {f["value"]: f["count"] for f in facets if f["facet"] == "totals"} == {"rows": 10, "duplicates": 0}


def test_source_captions_are_joined_by_each_samples_own_caption_key(tmp_path: Path) -> None:
    """Two samples of one content with their own source captions each show their own, named as a
    source caption, with the caption checks' verdict; a model caption is joined by content."""
    from prx_core.models.caption_base import CaptionerConfig
    from prx_core.models.caption_keys import source_caption_key

    storage, source = Storage(str(tmp_path / "root")), CaptionerConfig("source").version()
    two = base(2).set_column(1, "content_id", pa.array(["c0", "c0"], pa.string()))
    keys = [source_caption_key("c0", f"photo {i}") for i in range(2)]
    inputs = {"captions": write(storage, "captions", [
        {"content_id": keys[0], "captioner_version": source, "captioner_id": "source", "caption": "photo 0",
         "word_count": 2, "error": "", "verdict": "ok", "attempts": 0},
        {"content_id": keys[1], "captioner_version": source, "captioner_id": "source", "caption": "photo 1",
         "word_count": 2, "error": "", "verdict": "flagged", "problem": "boilerplate", "attempts": 0},
        {"content_id": "c0", "captioner_version": "m1", "captioner_id": "transformers:tiny:0123456789ab",
         "caption": "a loop a loop a loop", "word_count": 6, "error": "", "verdict": "rejected",
         "problem": "repetition", "attempts": 2}])}
    rows = explore_rows(storage, inputs, two, {"captioner_version": source, "labeler_version": "l1"}).to_pylist()
    assert [r["caption"] for r in rows] == ["photo 0", "photo 1"] and [r["caption_key"] for r in rows] == keys
    assert [r["captioner_id"] for r in rows] == ["source", "source"]
    assert [(r["caption_verdict"], r["caption_problem"]) for r in rows] == [("ok", None), ("flagged", "boilerplate")]
    model = explore_rows(storage, inputs, two, {"captioner_version": "m1", "labeler_version": "l1"}).to_pylist()
    assert [r["caption"] for r in model] == ["a loop a loop a loop"] * 2 and model[0]["caption_key"] is None
    assert (model[0]["captioner_id"], model[0]["caption_verdict"], model[0]["caption_attempts"]) == (
        "transformers:tiny:0123456789ab", "rejected", 2)
    assert model[0]["caption_repetition"] == 0.5  # 2 of its 4 word 3-grams distinct
