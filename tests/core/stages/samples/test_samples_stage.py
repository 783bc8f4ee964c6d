"""`samples` as work units over the demo sources (real readers, real Lance, a real local Ray):
any unit size gives the same rows and rejects, one unit writes one fragment, ids are counted on
workers, and a rerun after a changed source starts a new attempt."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import lance
import pytest

from prx_core.compute.parallel import Throttle
from prx_core.compute.units import RUNS
from prx_core.sources.catalog import load_catalog
from prx_core.stages.samples.refusals import EmptySource, SourceRefused
from prx_core.stages.samples.stage import build_samples, count_sample_ids, rejected_files
from prx_core.stages.samples.units import group_fragments
from prx_core.store import lance_io
from prx_core.store.partitions import rejects_predicate, source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")


def digests(storage: Storage, source: str) -> tuple[str, str]:
    return (lance_io.partition_digest(storage.lance_uri("samples"), source_predicate(source)),
            lance_io.partition_digest(storage.lance_uri("rejects"), rejects_predicate(source, "samples")))


@pytest.mark.parametrize("source", ["stock_photos", "web_images", "crawl_wds"])
def test_unit_size_changes_the_layout_never_the_rows(demo_dir: Path, tmp_path: Path, source: str) -> None:
    spec = load_catalog(demo_dir / "sources.yaml").get(source)
    one, many = Storage(str(tmp_path / "one")), Storage(str(tmp_path / "many"))
    whole = build_samples(spec, one)
    split = build_samples(spec, many, unit_bytes=1)  # every source fragment its own unit
    assert whole.units.units == 1 and split.units.units == split.fragments_read >= 2
    assert digests(one, source) == digests(many, source)
    assert (whole.rows, whole.rejected, whole.reasons) == (split.rows, split.rejected, split.reasons)
    assert len(lance.dataset(one.lance_uri("samples")).get_fragments()) == 1  # fragment scale from the start
    ids = count_sample_ids(many, source, split.samples_version)
    assert ids.rows == ids.distinct == split.rows and ids.examples == []
    assert len(rejected_files(one, source)) == min(50, whole.rejected)
    assert not list(Path(one.root, RUNS, "samples", source).iterdir())


def test_duplicate_sample_ids_are_counted_with_examples(demo_dir: Path, tmp_path: Path) -> None:
    """Two copies of one parquet file under different names give the same keys (key column)."""
    spec = load_catalog(demo_dir / "sources.yaml").get("stock_photos")
    copy = tmp_path / "photos"
    shutil.copytree(spec.uri, copy)
    first = sorted(copy.glob("*.parquet"))[0]
    shutil.copy(first, copy / "part-99999.parquet")
    doubled = dataclasses.replace(spec, uri=str(copy))
    storage = Storage(str(tmp_path / "corpus"))
    report = build_samples(doubled, storage, unit_bytes=1)
    ids = count_sample_ids(storage, spec.name, report.samples_version)
    assert ids.rows == report.rows and ids.duplicate_rows > 0
    assert ids.examples and all(e.startswith("stock_photos/") for e in ids.examples)


def test_a_changed_source_starts_a_new_attempt(demo_dir: Path, tmp_path: Path) -> None:
    spec = load_catalog(demo_dir / "sources.yaml").get("crawl_wds")
    copy = tmp_path / "wds"
    shutil.copytree(spec.uri, copy)
    moved = dataclasses.replace(spec, uri=str(copy))
    storage = Storage(str(tmp_path / "corpus"))
    before = build_samples(moved, storage, unit_bytes=1)
    sorted(copy.glob("*.tar"))[-1].unlink()
    after = build_samples(moved, storage, unit_bytes=1)
    assert after.units.units == before.units.units - 1 and after.units.skipped == 0
    assert after.rows < before.rows



def test_an_unchanged_source_is_not_ingested_again(demo_dir: Path, tmp_path: Path) -> None:
    """The weekly refresh of a source whose files did not change: a listing, then nothing run or
    committed; its report is the last committed one, every unit counted as skipped."""
    spec = load_catalog(demo_dir / "sources.yaml").get("crawl_wds")
    storage = Storage(str(tmp_path / "corpus"))
    first = build_samples(spec, storage, unit_bytes=1)
    version = lance_io.table_version(storage.lance_uri("samples"))
    lines: list[str] = []
    again = build_samples(spec, storage, unit_bytes=1, progress=Throttle(lines.append, "samples[crawl_wds]"))
    assert lines == ["samples[crawl_wds]: unchanged since its last commit (same inputs, code and settings): "
                     "nothing to run"]
    assert (again.rows, again.units.units, again.units.ran) == (first.rows, first.units.units, 0)
    assert again.units.skipped == first.units.units and lance_io.table_version(storage.lance_uri("samples")) == version
    resized = build_samples(spec, storage)  # another manifest (unit size): ingested again, the same rows
    assert resized.units.ran == resized.units.units == 1 and resized.rows == first.rows
    shutil.rmtree(storage.lance_uri("samples"))  # its output gone: the same manifest does the work again
    assert build_samples(spec, storage).units.ran == 1

def test_group_fragments_is_stable_and_bounded() -> None:
    sizes = [(f"f{i}", s) for i, s in enumerate([5, 5, 5, 20, 1, 1])]
    units = group_fragments(sizes, 10)
    assert [u.spec["fragments"] for u in units] == [["f0", "f1"], ["f2"], ["f3"], ["f4", "f5"]]
    assert [u.id for u in units] == ["u000000", "u000001", "u000002", "u000003"]
    assert group_fragments(sizes, 10) == units and group_fragments([], 10) == []


def test_an_empty_source_never_silently_empties_its_partition(demo_dir: Path, tmp_path: Path) -> None:
    """A source folder that still exists but matches no file: refused while the partition holds
    rows (they stay whole), emptied only when the run allows it."""
    spec = load_catalog(demo_dir / "sources.yaml").get("stock_photos")
    copy = tmp_path / "photos"
    shutil.copytree(spec.uri, copy)
    moved = dataclasses.replace(spec, uri=str(copy))
    storage = Storage(str(tmp_path / "corpus"))
    first = build_samples(moved, storage)
    before = digests(storage, "stock_photos")
    for path in copy.glob("*.parquet"):
        path.unlink()
    refusal = r"source 'stock_photos' .* yielded no sample .* holds \d+ rows: refusing.*`allow_empty: true`"
    with pytest.raises(EmptySource, match=refusal):
        build_samples(moved, storage)
    assert digests(storage, "stock_photos") == before and first.rows > 0
    emptied = build_samples(moved, storage, allow_empty=True)
    assert (emptied.rows, emptied.rejected) == (0, 0)
    count = lance.dataset(storage.lance_uri("samples")).count_rows(filter=source_predicate("stock_photos"))
    assert count == 0
    with pytest.raises(SourceRefused, match=r"source 'stock_photos' .* matched no file: nothing to ingest"):
        build_samples(moved, storage)  # nothing left to lose, yet a source that yields nothing still fails, saying why
