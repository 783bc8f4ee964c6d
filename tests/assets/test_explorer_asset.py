"""`explorer`: one denormalized row per sample and ingest reject, equal to the tables it joins, and
its facet counts equal to the rows; a rerun over unchanged inputs writes nothing, a changed
skip-list is seen."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from demo_corpus import Corpus, SOURCES, copy_corpus, read, version_of
from materializing import fresh_instance, materialize, materialized, resources_for

from prx_core.shards.skiplists.files import list_skip_files, read_skip_lists
from prx_core.store import lance_io


def explorer_rows(root: Path, source: str) -> dict[str, dict]:
    rows = read(root, "explorer", filter=f"source = '{source}'").to_pylist()
    assert len(rows) == len({r["sample_id"] for r in rows}), "one row per sample_id"
    return {r["sample_id"]: r for r in rows}


@pytest.mark.parametrize("source", SOURCES)
def test_every_sample_and_ingest_reject_has_one_row_equal_to_its_tables(corpus: Corpus, source: str) -> None:
    rows = explorer_rows(corpus.root, source)
    samples = {r["sample_id"]: r for r in corpus.rows("samples", filter=f"source = '{source}'")}
    ingest = {r["sample_id"]: r for r in corpus.rows("rejects", filter=f"source = '{source}' AND stage = 'samples'")
              if r["sample_id"] not in samples}
    assert set(rows) == set(samples) | set(ingest)
    assert {s for s, r in rows.items() if r["stored"]} == set(samples)
    for sid, sample in samples.items():
        assert (rows[sid]["width"], rows[sid]["height"], rows[sid]["content_id"], rows[sid]["original_caption"]) == (
            sample["width"], sample["height"], sample["content_id"], sample["original_caption"])
    for sid, reject in ingest.items():
        assert (rows[sid]["reject_reason"], rows[sid]["reject_stage"]) == (reject["reason"], "samples")
    buckets = {r["sample_id"]: r for r in corpus.rows("buckets", filter=f"source = '{source}'")}
    assert {s: (r["tier"], r["bucket"]) for s, r in rows.items() if s in buckets} == {
        s: (b["tier"], b["bucket"]) for s, b in buckets.items()}
    placed = {r["sample_id"]: r["index"] for r in corpus.rows("mds_index", filter=f"source = '{source}'")}
    assert {s: r["mds_index"] for s, r in rows.items() if r["mds_index"] is not None} == placed
    version = corpus.resources["captioner"].config().version()
    keys = corpus.caption_keys(source)
    captions = {r["content_id"]: r["caption"] for r in corpus.rows("captions") if r["captioner_version"] == version}
    assert all(r["caption"] == captions.get(keys[s]) for s, r in rows.items() if r["stored"])
    assert sum(r["caption"] is not None for r in rows.values()) > 0
    labels = corpus.labels(source)
    assert all(r["label"] == labels[s] for s, r in rows.items() if r["stored"])


@pytest.mark.parametrize("source", SOURCES)
def test_skip_reasons_are_the_skip_lists(corpus: Corpus, source: str) -> None:
    rows = explorer_rows(corpus.root, source)
    expected: dict[str, set[str]] = {}
    for skip in read_skip_lists(str(corpus.root), source):
        for sid in skip.sample_ids:
            expected.setdefault(sid, set()).add(skip.reason)
    assert {s: set(r["skip_reason"].split(",")) for s, r in rows.items() if r["skip_reason"]} == expected


def test_facets_count_the_rows(corpus: Corpus) -> None:
    facets = corpus.rows("explorer_facets")
    assert {f["source"] for f in facets} == set(SOURCES)
    for source in SOURCES:
        rows = list(explorer_rows(corpus.root, source).values())
        got = {(f["facet"], f["value"]): f["count"] for f in facets if f["source"] == source
               and f["facet"] not in ("side", "aspect", "totals") and not f["facet"].startswith("worst_")}
        totals = {f["value"]: f["count"] for f in facets if f["source"] == source and f["facet"] == "totals"}
        assert totals["rows"] == len(rows) and totals["in_mds"] == sum(r["mds_index"] is not None for r in rows)
        assert totals["duplicates"] == sum(r["keeper"] is False for r in rows)
        sized = sum(f["count"] for f in facets if f["source"] == source and f["facet"] == "side")
        assert sized == sum(f["count"] for f in facets if f["source"] == source and f["facet"] == "aspect") == sum(
            bool(r["width"] and r["height"]) for r in rows)
        want: Counter[tuple[str, str]] = Counter()
        for row in rows:
            for facet, column in (("label", "label"), ("tier", "tier"), ("bucket", "bucket"),
                                  ("rejected", "reject_reason"), ("meta", "meta_label"), ("group", "group_id"),
                                  ("caption", "caption_problem")):
                if row[column] not in (None, ""):
                    want[(facet, str(row[column]))] += 1
            for reason in (row["skip_reason"] or "").split(","):
                want[("skipped", reason)] += bool(reason)
        assert got == {k: v for k, v in want.items() if v}, source
        longest = {f["value"]: f["count"] for f in facets if f["source"] == source and f["facet"] == "worst_longest"}
        words = {r["sample_id"]: r["word_count"] for r in rows if r["caption"]}
        assert longest and all(words[s] == n for s, n in longest.items())
        assert min(longest.values()) >= sorted(words.values(), reverse=True)[len(longest) - 1]


def test_the_table_is_indexed_for_pages(corpus: Corpus) -> None:
    ds = lance_io.open_table(str(corpus.root / "lance" / "explorer.lance"))
    names = {i.name for i in ds.describe_indices()}
    assert {"source_bitmap", "label_bitmap", "bucket_bitmap", "sample_id_btree", "group_id_btree",
            "search_text_fts"} <= names and not {"caption_fts", "original_caption_fts"} & names  # one doc set, not two


def test_metadata_names_rows_and_versions(corpus: Corpus) -> None:
    for source in SOURCES:
        meta = corpus.metadata("explorer", source)
        assert meta["dagster/row_count"] == len(explorer_rows(corpus.root, source))
        assert meta["lance_versions"]["explorer"] == version_of(corpus.root, "explorer") or len(SOURCES) > 1


def test_a_rerun_writes_nothing_and_a_changed_skip_list_is_seen(corpus: Corpus, tmp_path: Path) -> None:
    root = copy_corpus(corpus, tmp_path / "root")
    resources = resources_for(corpus, root)
    source = next(s for s in SOURCES if list_skip_files(str(root), s))
    before = version_of(root, "explorer")
    result = materialize(resources, ["explorer"], source, fresh_instance(corpus.catalog))
    assert result.success and version_of(root, "explorer") == before
    rows = explorer_rows(root, source)
    assert any(r["skip_reason"] for r in rows.values())
    for path in list_skip_files(str(root), source):  # a policy that skips nothing any more
        Path(path).unlink()
    result = materialize(resources, ["explorer"], source, fresh_instance(corpus.catalog))
    assert result.success, result.all_events
    assert version_of(root, "explorer") > before
    assert not any(r["skip_reason"] for r in explorer_rows(root, source).values())
    assert materialized(result)["explorer"]["dagster/row_count"] == len(rows)
