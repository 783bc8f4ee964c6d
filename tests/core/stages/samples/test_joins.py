"""Joins as users have them: images in one parquet table, captions in another (parquet, keyed by
id), CLIP vectors in a lancedb table; missing and repeated keys on the joined side. Through the
real `samples` stage on a local Ray, from a catalog file; plus a WebDataset and an image folder
joined by their own keys, staging reuse and re-staging, and the staging failures."""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from prx_core.compute.parallel import Throttle
from prx_core.demo.photos import load_skimage_photos
from prx_core.sources.catalog import JoinSpec, load_catalog
from prx_core.stages.samples.join_tables import STATE, JoinStagingError, staged_batch
from prx_core.stages.samples.stage import SourceRefused, build_samples
from prx_core.store import lance_io
from prx_core.store.partitions import rejects_predicate, source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
IDS = [f"a{i}" for i in range(8)]


def tiles(count: int) -> list[bytes]:
    """`count` distinct real photos: 160x120 crops of scikit-image's samples, as JPEG."""
    out = []
    photos = load_skimage_photos()
    for i in range(count):
        image = photos[i % len(photos)].image.convert("RGB")
        left = 7 * (i // len(photos))
        buffer = io.BytesIO()
        image.crop((left, 0, left + 160, 120)).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def vector(i: int) -> list[float]:
    return (np.arange(512, dtype=np.float32) / 512 + i).tolist()


def write_joined(root: Path) -> Path:
    """images/ (id, image, license, an own caption for a1 and a blank one for a2), captions/ in two
    files (a0 given again in the second, a4 and a7 missing), clip/clip.lance by lancedb (512-d
    vectors and a `text` caption; a6 twice, a7 missing); returns the catalog file."""
    import lancedb

    images = tiles(len(IDS))
    (root / "images").mkdir(parents=True)
    own = {"a1": "own caption of a1", "a2": "  "}
    for part, ids in enumerate((IDS[:4], IDS[4:])):
        pq.write_table(pa.table({"id": ids, "image": pa.array([images[IDS.index(k)] for k in ids], pa.binary()),
                                 "license": ["cc-by-4.0"] * len(ids), "caption": [own.get(k) for k in ids]}),
                       root / "images" / f"part-{part}.parquet")
    (root / "captions").mkdir()
    pq.write_table(pa.table({"id": ["a0", "a1", "a2", "a3", "a5", "a6"],
                             "caption": ["a0 from the first file", "joined a1", "joined a2", "joined a3", "joined a5",
                                         "joined a6"],
                             "site": ["s0", "s1", "s2", "s3", "s5", None]}), root / "captions" / "c-0.parquet")
    pq.write_table(pa.table({"id": ["a0"], "caption": ["a0 from the second file"], "site": ["again"]}),
                   root / "captions" / "c-1.parquet")
    clip_ids = ["a0", "a1", "a2", "a3", "a4", "a5", "a6", "a6"]
    rows = [{"id": k, "clip": vector(100 + n if n == 7 else IDS.index(k)), "text": f"clip text of {k}"}
            for n, k in enumerate(clip_ids)]
    schema = pa.schema([("id", pa.string()), ("clip", pa.list_(pa.float32(), 512)), ("text", pa.string())])
    lancedb.connect(str(root / "clip")).create_table("clip", pa.Table.from_pylist(rows, schema=schema))
    catalog = root / "sources.yaml"
    catalog.write_text(yaml.safe_dump({"sources": [{
        "name": "joined", "format": "parquet", "uri": "images", "image_column": "image", "key_column": "id",
        "caption_column": "caption", "metadata_columns": ["license"],
        "joins": [{"uri": "captions", "key_column": "id", "caption_column": "caption", "metadata_columns": ["site"]},
                  {"uri": "clip/clip.lance", "key_column": "id", "embedding_column": "clip",
                   "caption_column": "text"}]}]}))
    return catalog


def samples_of(storage: Storage, source: str) -> dict[str, dict]:
    rows = lance_io.read_table(storage.lance_uri("samples"), filter=source_predicate(source),
                               columns=["source_key", "original_caption", "embedding", "metadata"]).to_pylist()
    return {r["source_key"]: {**r, "metadata": dict(r["metadata"] or [])} for r in rows}


def rejects_of(storage: Storage, source: str) -> dict[str, dict]:
    rows = lance_io.read_table(storage.lance_uri("rejects"), filter=rejects_predicate(source, "samples")).to_pylist()
    return {r["source_key"]: r for r in rows}


def digests(storage: Storage, source: str) -> tuple[str, str]:
    return (lance_io.partition_digest(storage.lance_uri("samples"), source_predicate(source)),
            lance_io.partition_digest(storage.lance_uri("rejects"), rejects_predicate(source, "samples")))


def staged(storage: Storage, source: str) -> dict[str, int]:
    """Staged table name -> its Lance version."""
    folder = Path(storage.uri(*STATE, source))
    return {p.name: lance.dataset(str(p)).version for p in sorted(folder.iterdir())} if folder.exists() else {}


def test_captions_embeddings_and_metadata_are_joined_by_key(tmp_path: Path) -> None:
    spec = load_catalog(write_joined(tmp_path / "data")).get("joined")
    storage = Storage(str(tmp_path / "corpus"))
    lines: list[str] = []
    report = build_samples(spec, storage, unit_bytes=1,  # one unit per images file: each looks up its own keys
                           progress=Throttle(lines.append, "samples[joined]"))
    assert report.units.units == 2 and report.rows == len(IDS)
    assert any(line.startswith("samples[joined]: staging joined tables: 3/3 files") for line in lines), lines
    got = samples_of(storage, "joined")
    assert {k: v["original_caption"] for k, v in got.items()} == {
        "a0": "a0 from the first file",  # repeated in c-1.parquet: the first file's row is used
        "a1": "own caption of a1",  # the source's own caption wins
        "a2": "joined a2",  # a blank own caption counts as none
        "a3": "joined a3",
        "a4": "clip text of a4",  # not in the captions table: the next join that gives one
        "a5": "joined a5", "a6": "joined a6",
        "a7": None}  # in no joined table: no caption
    for i, key in enumerate(IDS[:7]):
        assert got[key]["embedding"] == pytest.approx(vector(i)), key  # a6: its first lancedb row, not 100 + 7
    assert got["a7"]["embedding"] is None
    assert got["a0"]["metadata"] == {"license": "cc-by-4.0", "site": "s0"}
    assert got["a6"]["metadata"] == got["a7"]["metadata"] == {"license": "cc-by-4.0"}  # a null site, a missing key
    rejects = rejects_of(storage, "joined")
    assert set(rejects) == {"a0#join0.1", "a6#join1.1"} and report.reasons == {"duplicate_key": 2}
    first, second = rejects["a0#join0.1"], rejects["a6#join1.1"]
    assert first["reason"] == second["reason"] == "duplicate_key" and first["stage"] == "samples"
    assert first["sample_id"] == "joined/a0#join0.1"
    assert "'a0'" in first["message"] and str(tmp_path / "data" / "captions") in first["message"]
    assert "c-1.parquet row 0" in first["message"] and "first row (c-0.parquet row 0)" in first["message"]
    assert "clip.lance" in second["message"] and "fragment 0 row 7" in second["message"]

    one = Storage(str(tmp_path / "one"))
    build_samples(spec, one)  # one unit for the whole source: the same rows and rejects
    assert digests(one, "joined") == digests(storage, "joined")


def test_a_rerun_reuses_the_staged_tables_and_a_changed_table_is_staged_again(tmp_path: Path) -> None:
    catalog = write_joined(tmp_path / "data")
    spec = load_catalog(catalog).get("joined")
    storage = Storage(str(tmp_path / "corpus"))
    build_samples(spec, storage)
    before, tables = digests(storage, "joined"), staged(storage, "joined")
    assert len(tables) == 2 and all(v == 2 for v in tables.values())  # one commit and one index build each
    index = lance.dataset(str(Path(storage.uri(*STATE, "joined")) / next(iter(tables)))).describe_indices()
    assert [(d.name, d.index_type) for d in index] == [("key_btree", "BTree")]
    build_samples(spec, storage)
    assert staged(storage, "joined") == tables and digests(storage, "joined") == before  # nothing staged again
    lost = sorted(tables)[0]  # as if a run had died before committing that one: only it is staged again
    shutil.rmtree(Path(storage.uri(*STATE, "joined")) / lost)
    build_samples(spec, storage)
    assert staged(storage, "joined") == tables and digests(storage, "joined") == before

    pq.write_table(pa.table({"id": ["a7"], "caption": ["a7 added later"], "site": ["s7"]}),
                   tmp_path / "data" / "captions" / "c-2.parquet")
    build_samples(spec, storage)
    now = staged(storage, "joined")
    assert len(now) == 2 and len(set(now) & set(tables)) == 1  # the captions table re-staged, the old one removed
    assert samples_of(storage, "joined")["a7"]["original_caption"] == "a7 added later"


def test_webdataset_and_image_folder_sources_join_by_their_own_keys(tmp_path: Path) -> None:
    import webdataset

    images = tiles(3)
    (tmp_path / "wds").mkdir()
    with webdataset.TarWriter(str(tmp_path / "wds" / "shard-000000.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"w{i}", "jpg": images[i], **({"txt": "own caption"} if i == 0 else {})})
    (tmp_path / "folder" / "cats").mkdir(parents=True)
    for i in range(2):
        Image.open(io.BytesIO(images[i])).save(tmp_path / "folder" / "cats" / f"f{i}.jpg", quality=90)
    (tmp_path / "captions").mkdir()
    pq.write_table(pa.table({"key": ["w0", "w1", "cats/f0", "cats/f1"],
                             "caption": ["joined w0", "joined w1", "joined f0", "joined f1"],
                             "score": [0.5, 0.25, 1.0, None]}), tmp_path / "captions" / "part-0.parquet")
    (tmp_path / "empty").mkdir()  # a joined table with no row, and one whose keys are all null: nothing joined
    pq.write_table(pa.table({"key": pa.array([], pa.string()), "caption": pa.array([], pa.string())}),
                   tmp_path / "empty" / "part-0.parquet")
    pq.write_table(pa.table({"key": pa.array([None], pa.string()), "caption": ["orphan"]}),
                   tmp_path / "empty" / "part-1.parquet")
    joins = [{"uri": "empty", "key_column": "key", "caption_column": "caption"},
             {"uri": "captions", "key_column": "key", "caption_column": "caption", "metadata_columns": ["score"]}]
    (tmp_path / "sources.yaml").write_text(yaml.safe_dump({"sources": [
        {"name": "wds", "format": "webdataset", "uri": "wds", "joins": joins},
        {"name": "folder", "format": "imagefolder", "uri": "folder", "joins": joins}]}))
    catalog = load_catalog(tmp_path / "sources.yaml")
    storage = Storage(str(tmp_path / "corpus"))
    build_samples(catalog.get("wds"), storage)
    build_samples(catalog.get("folder"), storage)
    wds, folder = samples_of(storage, "wds"), samples_of(storage, "folder")
    assert {k: (v["original_caption"], v["metadata"]) for k, v in wds.items()} == {
        "w0": ("own caption", {"score": "0.5"}), "w1": ("joined w1", {"score": "0.25"}), "w2": (None, {})}
    assert {k: v["original_caption"] for k, v in folder.items()} == {"cats/f0": "joined f0", "cats/f1": "joined f1"}
    assert folder["cats/f0"]["metadata"]["score"] == "1.0" and "score" not in folder["cats/f1"]["metadata"]


def test_a_table_that_cannot_be_staged_fails_the_run_before_ingest(tmp_path: Path) -> None:
    catalog = write_joined(tmp_path / "data")
    document = yaml.safe_load(catalog.read_text())
    document["sources"][0]["joins"][0]["caption_column"] = "text"  # the captions table has none
    catalog.write_text(yaml.safe_dump(document))
    storage = Storage(str(tmp_path / "corpus"))
    with pytest.raises(SourceRefused) as failed:  # the asset's one-line failure, as for any refused source
        build_samples(load_catalog(catalog).get("joined"), storage)
    line = str(failed.value)
    assert isinstance(failed.value.__cause__, JoinStagingError)
    assert "\n" not in line and line.startswith("source 'joined': joined table ")
    assert str(tmp_path / "data" / "captions") in line and "joins[0]" in line and "['text']" in line
    assert re.search(r"c-[01]\.parquet has no column", line) and "fix joins[0]'s column names" in line  # either file
    assert not lance_io.table_exists(storage.lance_uri("samples"))  # nothing was ingested

    (tmp_path / "data" / "captions" / "c-1.parquet").write_bytes(b"PAR1 this is not parquet")
    document["sources"][0]["joins"][0]["caption_column"] = "caption"
    catalog.write_text(yaml.safe_dump(document))
    with pytest.raises(SourceRefused, match=r"c-1\.parquet: .*replace or remove that file"):
        build_samples(load_catalog(catalog).get("joined"), storage)

    shutil.rmtree(tmp_path / "data" / "clip")
    with pytest.raises(SourceRefused, match=r"clip\.lance \(joins\[1\]\) cannot be staged: .*fix joins\[1\]\.uri"):
        build_samples(load_catalog(catalog).get("joined"), storage)
    assert not lance_io.table_exists(storage.lance_uri("samples"))


def test_staged_rows_keep_their_place_in_the_joined_file() -> None:
    """Keys become text (an int id joins a source's text key), a null key is left out without
    shifting the row numbers a duplicate_key message names, metadata values become strings."""
    batch = pa.record_batch({"id": pa.array([7, None, 9]), "text": ["x", "y", None], "score": [0.5, 1.0, None],
                             "clip": pa.array([[1.0, 2.0], None, [3.0, 4.0]], pa.list_(pa.float64()))})
    join = JoinSpec(uri="t", key_column="id", caption_column="text", embedding_column="clip",
                    metadata_columns=("score",))
    assert staged_batch(join, batch, 2, 10).to_pylist() == [
        {"key": "7", "file": 2, "row": 10, "caption": "x", "embedding": [1.0, 2.0], "metadata": [("score", "0.5")]},
        {"key": "9", "file": 2, "row": 12, "caption": None, "embedding": [3.0, 4.0], "metadata": None}]
