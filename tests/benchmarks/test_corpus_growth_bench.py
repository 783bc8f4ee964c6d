"""The corpus-growth benchmark's parts that decide what it measures: the padding rows (other
sources, new keys that sort among the real ones, no bytes a unit could read by mistake), padding a
real Lance table with its key indexes kept, and the arithmetic of the report. Its runs (a source built through the stages, then 1M-16M padding rows) are by hand:
docs/benchmarks.md has the figures and the command."""

from __future__ import annotations

from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from benchmarks.corpus_growth import OTHERS, filler_rows, growth, pad_table, template_rows, unit_reads
from prx_core.store import schemas

SOURCE = "bench"


def samples_rows(n: int) -> pa.Table:
    rows = [{"sample_id": f"{SOURCE}/k{i}", "content_id": f"{i:064x}", "source": SOURCE, "source_key": f"k{i}",
             "image": b"x" * 1000, "width": 448, "height": 336, "original_caption": f"photo {i}",
             "signature": b"s" * 384, "match_keys": [1, 2]} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=schemas.SAMPLES)


def test_filler_rows_belong_to_other_sources_with_new_keys_and_no_bytes() -> None:
    template = samples_rows(3)
    rows = filler_rows(template, 10, 7)
    assert rows.schema == template.schema and rows.num_rows == 7
    sources = rows["source"].to_pylist()
    assert sources == [f"other{p % OTHERS:02d}" for p in range(10, 17)]
    assert all(s.startswith(f"{src}/") for s, src in zip(rows["sample_id"].to_pylist(), sources))
    ids = rows["content_id"].to_pylist()
    assert len(set(ids)) == 7 and not set(ids) & set(template["content_id"].to_pylist())
    assert all(len(i) == 64 for i in ids)
    for column in ("image", "signature", "match_keys", "metadata"):
        assert rows[column].null_count == 7, column
    # the other columns repeat the template's rows in turn
    assert rows["original_caption"].to_pylist() == [f"photo {p % 3}" for p in range(10, 17)]


def test_a_caption_key_keeps_its_length_and_sorts_by_its_new_content() -> None:
    keys = [f"{i:064x}" + "ab" * 16 for i in range(2)]  # a content id, then a 32-digit hash: the `source` captioner's
    template = pa.table({"content_id": keys, "label": ["visual", "text"]})
    rows = filler_rows(template, 0, 4)
    new = rows["content_id"].to_pylist()
    assert all(len(k) == 96 and k.endswith("ab" * 16) for k in new)
    assert len({k[:64] for k in new}) == 4


def test_an_empty_table_gets_a_made_up_template_row(tmp_path: Path) -> None:
    uri = str(tmp_path / "duplicates.lance")
    lance.write_dataset(schemas.DUPLICATES.empty_table(), uri)
    (row,) = template_rows(lance.dataset(uri), SOURCE).to_pylist()
    assert row["source"] == SOURCE and row["keeper"] is False and row["sample_id"].startswith(f"{SOURCE}/")


def test_padding_appends_other_sources_and_keeps_the_key_indexes_caught_up(tmp_path: Path) -> None:
    uri = str(tmp_path / "samples.lance")
    lance.write_dataset(samples_rows(50), uri)
    pad_table(uri, "samples", SOURCE, 0, 400)
    pad_table(uri, "samples", SOURCE, 400, 1000)
    ds = lance.dataset(uri)
    assert ds.count_rows() == 1050 and ds.count_rows(f"source = '{SOURCE}'") == 50
    assert ds.to_table(filter=f"source = '{SOURCE}'")["image"].null_count == 0  # the source's own rows untouched
    assert pc.count_distinct(ds.to_table(columns=["sample_id"])["sample_id"]).as_py() == 1050
    indexed = {d.name: d for d in ds.describe_indices()}
    assert {"sample_id_btree", "content_id_btree", "source_bitmap"} <= set(indexed)
    fragments = {f.fragment_id for f in ds.get_fragments()}
    for name in ("sample_id_btree", "content_id_btree", "source_bitmap"):
        covered = set().union(*(s.fragment_ids for s in indexed[name].segments))
        assert covered == fragments, name


def test_the_report_takes_medians_per_unit_and_the_growth_from_the_smallest_corpus() -> None:
    result = {"units": {"chunks": {"unit_read_bytes": [1e6, 3e6, 2e6], "unit_seconds": [0.1, 0.3, 0.2]},
                        "streams": {"unit_read_bytes": [], "unit_seconds": []}}}
    assert unit_reads(result) == {"chunks": {"units": 3, "read_mb": 2.0, "read_mb_max": 3.0, "seconds": 0.2}}
    sizes = [{"stages": {"skip_lists": {"chunks": {"read_mb": 2.0}}, "buckets": {"units": {"read_mb": 0.5}}}},
             {"stages": {"skip_lists": {"chunks": {"read_mb": 9.0}}, "buckets": {"units": {"read_mb": 0.55}}}}]
    assert growth(sizes) == {"skip_lists/chunks": 4.5, "buckets/units": 1.1}


def test_an_unknown_stage_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.corpus_growth import main

    with pytest.raises(SystemExit):
        main(["--stages", "skip_lists,samples"])  # samples is built, not measured
    assert "unknown stage samples" in capsys.readouterr().err
