"""A source that yields nothing says why, in one line (issue 22, item 6), through the real samples
stage on a local Ray: every row refused fails the run with the source, the counts, the dominant
reason with an example and the fix, after committing the rejects for inspection; a partition
holding samples is never replaced by an all-refused or empty source; `allow_empty` keeps both."""

from __future__ import annotations

import re
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_core.sources.catalog import SourceSpec
from prx_core.stages.samples.stage import EmptySource, SourceRefused, build_samples
from prx_core.stages.samples.refusals import FILE_HINTS, HINTS, examples_by_reason, first_examples, refused_line
from prx_core.store import lance_io
from prx_core.store.partitions import reject_row, rejects_predicate, source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")


def url_parquet(folder: Path, rows: int = 30, files: int = 2) -> SourceSpec:
    """A metadata-only table (URLs in the column named as the image column), as LAION ships."""
    folder.mkdir(parents=True)
    per_file = rows // files
    for f in range(files):
        table = pa.table({"key": [f"k{f}_{i}" for i in range(per_file)],
                          "image": [f"https://example.org/img/{f}_{i}.jpg".encode() for i in range(per_file)],
                          "caption": [f"a photo {f} {i}" for i in range(per_file)]})
        pq.write_table(table, folder / f"part-{f:05d}.parquet")
    return SourceSpec("laion", "parquet", str(folder), image_column="image", caption_column="caption", key_column="key")


def text_folder(folder: Path, count: int = 4) -> SourceSpec:
    """An image folder whose `.jpg` files are text."""
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f"img_{i}.jpg").write_text(f"this is not a JPEG, file {i}\n")
    return SourceSpec("texts", "imagefolder", str(folder))


def partition(storage: Storage, source: str) -> tuple[int, list[dict]]:
    samples = lance.dataset(storage.lance_uri("samples")).count_rows(filter=source_predicate(source))
    rejects = lance.dataset(storage.lance_uri("rejects")).to_table(
        columns=["source_key", "reason", "message"], filter=rejects_predicate(source, "samples")).to_pylist()
    return samples, rejects


def digests(storage: Storage, source: str) -> tuple[str, str]:
    return (lance_io.partition_digest(storage.lance_uri("samples"), source_predicate(source)),
            lance_io.partition_digest(storage.lance_uri("rejects"), rejects_predicate(source, "samples")))


def test_a_url_table_read_as_image_bytes_fails_with_the_cause_and_its_rejects_committed(tmp_path: Path) -> None:
    spec = url_parquet(tmp_path / "laion")
    storage = Storage(str(tmp_path / "corpus"))
    with pytest.raises(SourceRefused) as refused:
        build_samples(spec, storage, unit_bytes=1)  # two units: the counts and examples add up across them
    line = str(refused.value)
    assert type(refused.value) is SourceRefused and "\n" not in line
    assert line.startswith(f"source 'laion' (parquet at {spec.uri}): 30 of 30 rows refused, none kept (not_an_image 30")
    example = re.search(r"e\.g\. (\S+): \"([^\"]+)\"", line)
    assert example, line
    assert example[1] == "k0_0", line  # the first unit's first refused key
    assert HINTS["not_an_image"] in line and "rejects (stage samples" in line
    samples, rejects = partition(storage, "laion")
    assert samples == 0 and len(rejects) == 30 and {r["reason"] for r in rejects} == {"not_an_image"}
    assert example[2] == next(r["message"] for r in rejects if r["source_key"] == example[1])[:240]
    with pytest.raises(SourceRefused, match="30 of 30 rows refused"):  # a rerun says the same, nothing resumed
        build_samples(spec, storage, unit_bytes=1)


def test_a_folder_of_text_files_named_jpg_fails_with_the_cause(tmp_path: Path) -> None:
    spec = text_folder(tmp_path / "texts")
    storage = Storage(str(tmp_path / "corpus"))
    with pytest.raises(SourceRefused, match=r"^source 'texts' \(imagefolder at .*\): 4 of 4 rows refused, none kept "
                                            r"\(not_an_image 4, e\.g\. img_0: \"not a recognised image [^\"]+\"\)") as refused:
        build_samples(spec, storage)
    assert FILE_HINTS["not_an_image"] in str(refused.value) and "url_column" not in str(refused.value)
    samples, rejects = partition(storage, "texts")
    assert samples == 0 and sorted(r["source_key"] for r in rejects) == [f"img_{i}" for i in range(4)]


def test_an_all_refused_source_never_replaces_a_partition_holding_samples(tmp_path: Path, photos: list[bytes]) -> None:
    folder = tmp_path / "src"
    folder.mkdir()
    for i, photo in enumerate(photos):
        (folder / f"img_{i}.jpg").write_bytes(photo)
    spec = SourceSpec("texts", "imagefolder", str(folder))
    storage = Storage(str(tmp_path / "corpus"))
    assert build_samples(spec, storage).rows == 3
    before = digests(storage, "texts")
    for path in folder.iterdir():
        path.write_text("now a text file\n")
    with pytest.raises(EmptySource, match=r"3 of 3 rows refused.*Its partition holds 3 samples: kept whole, nothing "
                                          r"committed.*`allow_empty: true`"):
        build_samples(spec, storage)
    assert digests(storage, "texts") == before
    allowed = build_samples(spec, storage, allow_empty=True)  # on purpose: committed, not failed
    assert (allowed.rows, allowed.rejected, allowed.reasons) == (0, 3, {"not_an_image": 3})
    assert partition(storage, "texts")[0] == 0


def test_a_source_matching_no_file_fails_and_commits_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()  # (a folder holding other files is a catalog error naming them: prx_core.sources.readers)
    storage = Storage(str(tmp_path / "corpus"))
    spec = SourceSpec("nothing", "parquet", str(folder), image_column="image")
    with pytest.raises(SourceRefused, match=r"^source 'nothing' \(parquet at .*\) matched no file: nothing to ingest. "
                                            r"Likely fix: check the source's uri"):
        build_samples(spec, storage)
    assert not lance_io.table_exists(storage.lance_uri("samples")) and not lance_io.table_exists(
        storage.lance_uri("rejects"))
    assert build_samples(spec, storage, allow_empty=True).rows == 0


def test_the_line_ranks_reasons_and_takes_the_fix_from_the_table() -> None:
    spec = SourceSpec("hf", "parquet", "/data/hf", image_column="image")
    rows = [reject_row(f"hf/{k}", "hf", k, None, "samples", reason, message) for k, reason, message in [
        ("a.parquet", "unreadable_fragment", "ArrowInvalid: Unsupported cast from struct<bytes: binary, path: "
                                             "string> to large_binary\n  (after 0 rows)"),
        ("b.parquet", "unreadable_fragment", "second"), ("c.parquet:1", "empty", "no image bytes")]]
    units = [{"examples": examples_by_reason(pa.Table.from_pylist(rows[2:], schema=rejects_schema()))},
             {"examples": examples_by_reason(pa.Table.from_pylist(rows[:2], schema=rejects_schema()))}]
    line = refused_line(spec, {"unreadable_fragment": 2, "empty": 1}, first_examples(units))
    assert line == (
        "source 'hf' (parquet at /data/hf): 3 of 3 rows refused, none kept (unreadable_fragment 2, e.g. a.parquet: "
        "\"ArrowInvalid: Unsupported cast from struct<bytes: binary, path: string> to large_binary (after 0 rows)\"; "
        "also empty 1). Likely fix: the files cannot be read as `format: parquet`: check the source's format, uri and "
        "column names in the catalog against the files")
    unknown = refused_line(spec, {"some_new_reason": 1}, {})
    assert unknown.endswith("Likely fix: see the rejects (rejects.lance, stage samples, or the explorer) for every "
                            "refused row") and "e.g." not in unknown


def rejects_schema() -> pa.Schema:
    from prx_core.store import schemas

    return schemas.REJECTS
