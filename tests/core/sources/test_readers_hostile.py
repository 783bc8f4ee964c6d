"""Hostile sources (issue 15, items 2, 3, 6 and 7): links and special files in image folders,
oversized, unneeded and badly named tar members, gzip shards, and keys that would collide. Each
problem is one reject with a reason; the rest of the fragment still comes through."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import subprocess
import tarfile
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from prx_core.sources.catalog import CatalogError, SourceSpec, load_catalog
from prx_core.sources.ingest import ingest_batch
from prx_core.sources.readers import list_fragments, read_fragment, read_source


def rows(spec: SourceSpec) -> dict[str, dict]:
    """source_key -> record; a key given twice fails the test."""
    out: dict[str, dict] = {}
    for batch in read_source(spec):
        for row in batch.to_pylist():
            assert row["source_key"] not in out, f"duplicate key {row['source_key']!r}"
            out[row["source_key"]] = row
    return out


def reasons(spec: SourceSpec) -> dict[str, str | None]:
    return {key: row["reject_reason"] for key, row in rows(spec).items()}


def write_tar(path: Path, members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> Path:
    with tarfile.open(path, "w", format=fmt, encoding="utf-8", errors="surrogateescape") as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


def png(seed: int = 0) -> bytes:
    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (96, 128, 3), np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


# --- image folders: links, special files, the root ------------------------------------------------

def test_folder_refuses_links_and_special_files(tmp_path: Path) -> None:
    root, outside = tmp_path / "src", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    secret = outside / "environ"
    secret.write_text("AWS_SECRET_ACCESS_KEY=hunter2")
    (outside / "stolen.jpg").write_bytes(b"SECRET IMAGE hunter2")
    (root / "ok.jpg").write_bytes(b"plain image")
    (root / "ok.txt").write_text("a caption")
    (root / "env.jpg").write_bytes(b"image next to a linked caption")
    (root / "env.txt").symlink_to(secret)  # the caption that used to carry the worker's environment
    (root / "proc.jpg").write_bytes(b"image")
    (root / "proc.txt").symlink_to("/proc/self/environ")
    (root / "link.jpg").symlink_to(outside / "stolen.jpg")
    os.mkfifo(root / "pipe.jpg")  # opening it to read would block forever
    (root / "sub" / "deep.jpg").write_bytes(b"deep image")
    (root / "linked_dir").symlink_to(outside)
    spec = SourceSpec("f", "imagefolder", str(root))
    got = rows(spec)
    assert {k: r["reject_reason"] for k, r in got.items()} == {
        "ok": None, "env": "symlink", "proc": "symlink", "link": "symlink", "pipe": "not_regular_file",
        "sub/deep": None, "linked_dir": "symlink"}
    assert got["ok"]["caption"] == "a caption" and got["sub/deep"]["image"] == b"deep image"
    for row in got.values():
        assert b"hunter2" not in (row["image"] or b"") and "hunter2" not in (row["caption"] or "")
        assert "AWS_" not in (row["caption"] or "") and "PATH=" not in (row["caption"] or "")
    samples, refused = ingest_batch("f", pa.Table.from_batches(list(read_source(spec))))
    by_key = dict(zip(refused["source_key"].to_pylist(), refused["reason"].to_pylist()))
    assert {k: by_key[k] for k in ("env", "link", "pipe", "linked_dir")} == {
        "env": "symlink", "link": "symlink", "pipe": "not_regular_file", "linked_dir": "symlink"}
    assert all(m for m in refused["message"].to_pylist())


def test_a_linked_root_is_the_operators_choice(tmp_path: Path) -> None:
    (tmp_path / "v1" / "sub").mkdir(parents=True)
    (tmp_path / "v1" / "a.jpg").write_bytes(b"a")
    (tmp_path / "v1" / "sub" / "b.jpg").write_bytes(b"b")
    (tmp_path / "current").symlink_to(tmp_path / "v1")
    assert reasons(SourceSpec("f", "imagefolder", str(tmp_path / "current"))) == {"a": None, "sub/b": None}


def test_folder_fragment_outside_the_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.jpg").write_bytes(b"not yours")
    spec = SourceSpec("f", "imagefolder", str(tmp_path / "src"))
    with pytest.raises(ValueError, match="not under the source root"):
        list(read_fragment(spec, str(tmp_path / "src" / ".." / "other")))
    wds = SourceSpec("w", "webdataset", str(tmp_path / "src"))
    write_tar(tmp_path / "other" / "s.tar", [("a.jpg", b"x")])
    with pytest.raises(ValueError, match="not under the source root"):
        list(read_fragment(wds, str(tmp_path / "src" / ".." / "other" / "s.tar")))


def test_folder_with_a_non_utf8_name_keeps_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.jpg").write_bytes(b"a")
    with open(os.path.join(os.fsencode(root), b"bad\xff.jpg"), "wb") as handle:
        handle.write(b"bad")
    (root / "z.jpg").write_bytes(b"z")
    assert reasons(SourceSpec("f", "imagefolder", str(root))) == {"a": None, "bad\\xff": "bad_name", "z": None}


def test_folder_size_limits(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    (root / "big.jpg").write_bytes(b"x" * 2000)
    (root / "long.jpg").write_bytes(b"x")
    (root / "long.txt").write_text("y" * 200)
    (root / "ok.jpg").write_bytes(b"x" * 1000)
    spec = SourceSpec("f", "imagefolder", str(root), max_image_bytes=1000, max_caption_bytes=100)
    assert reasons(spec) == {"big": "image_too_large", "long": "caption_too_large", "ok": None}


# --- keys ---------------------------------------------------------------------------------------

def test_folder_keys_are_unique_when_stems_collide(tmp_path: Path) -> None:
    """`x.gif` and `x.webp` used to both be key `x`, and the blocking uniqueness check halted the source."""
    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    for name in ("x.gif", "x.webp", "x.txt", "y.jpg", "y.jpg.png", "d/x.jpg"):
        (root / name).write_bytes(name.encode())
    got = rows(SourceSpec("f", "imagefolder", str(root)))
    assert sorted(got) == ["d/x", "x.gif", "x.webp", "y", "y.jpg.png"]  # `y.jpg.png` would be stem `y.jpg`
    assert got["x.gif"]["caption"] == got["x.webp"]["caption"] == "x.txt"  # the shared sidecar


def test_parquet_default_keys_include_the_folder(tmp_path: Path) -> None:
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        pq.write_table(pa.table({"image": [b"1", b"2"]}), tmp_path / folder / "part-0.parquet")
    pq.write_table(pa.table({"image": [b"3"]}), tmp_path / "part-0.parquet")
    got = rows(SourceSpec("p", "parquet", str(tmp_path), image_column="image"))
    assert sorted(got) == ["a/part-0:0", "a/part-0:1", "b/part-0:0", "b/part-0:1", "part-0:0"]
    single = rows(SourceSpec("p", "parquet", str(tmp_path / "a" / "part-0.parquet"), image_column="image"))
    assert sorted(single) == ["part-0:0", "part-0:1"]


def test_null_and_repeated_key_columns_are_rejects(tmp_path: Path) -> None:
    table = pa.table({"k": ["a", None, "b", "a", "c"], "image": [b"1", b"2", b"3", b"4", b"x" * 50],
                      "caption": ["c1", "c2", "c3", "c4", "c5"]})
    pq.write_table(table, tmp_path / "part.parquet", row_group_size=2)
    spec = SourceSpec("p", "parquet", str(tmp_path), image_column="image", caption_column="caption", key_column="k",
                      max_image_bytes=10)
    batches = list(read_source(spec))
    records = pa.Table.from_batches(batches).to_pylist()
    assert [(r["source_key"], r["reject_reason"]) for r in records] == [
        ("a", None), ("part:1", "null_key"), ("b", None), ("a", "duplicate_key"), ("c", "image_too_large")]
    assert records[3]["image"] == b"" and records[3]["caption"] is None  # a refused row carries nothing
    _, refused = ingest_batch("p", pa.Table.from_batches(batches))
    by_key = dict(zip(refused["source_key"].to_pylist(), refused["reason"].to_pylist()))
    assert by_key["part:1"] == "null_key" and by_key["c"] == "image_too_large"
    assert refused["reason"].to_pylist().count("duplicate_key") == 1


def test_repeated_webdataset_keys_are_rejects(tmp_path: Path) -> None:
    write_tar(tmp_path / "s.tar", [("a.jpg", b"a1"), ("a.txt", b"first"), ("b.jpg", b"b"),
                                   ("a.jpg", b"a2"), ("a.txt", b"second")])
    got = [r for b in read_source(SourceSpec("w", "webdataset", str(tmp_path))) for r in b.to_pylist()]
    # the repeat is a reject under the same key: kept visible, never a second sample
    assert [(r["source_key"], r["image"], r["caption"], r["reject_reason"]) for r in got] == [
        ("a", b"a1", "first", None), ("b", b"b", None, None), ("a", b"", None, "duplicate_key")]


# --- tar shards: size limits, unneeded members, names, compression ---------------------------------

def sparse_tar(tmp_path: Path, members: dict[str, int | bytes]) -> Path:
    """A GNU sparse tar (a few KB on disk) whose sparse members expand to the given sizes."""
    work = tmp_path / "members"
    work.mkdir()
    for name, content in members.items():
        if isinstance(content, int):
            with open(work / name, "wb") as handle:
                handle.truncate(content)
        else:
            (work / name).write_bytes(content)
    shard = tmp_path / "src" / "s.tar"
    shard.parent.mkdir()
    subprocess.run(["tar", "--sparse", "-cf", str(shard), "-C", str(work), *members], check=True)
    assert shard.stat().st_size < 64 << 10
    return shard


def test_oversized_and_unneeded_members_are_never_read(tmp_path: Path) -> None:
    """A 20 KB shard declaring 2 x 100 MB members: the oversized image is a reject, the unneeded
    member is skipped, the shard's other samples come through, and no member is held in memory."""
    sparse_tar(tmp_path, {"a.jpg": b"image a", "a.npy": 100 << 20, "b.jpg": 100 << 20, "b.txt": b"cap b",
                          "c.jpg": b"image c"})
    spec = SourceSpec("w", "webdataset", str(tmp_path / "src"))
    tracemalloc.start()
    try:
        got = rows(spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert {k: r["reject_reason"] for k, r in got.items()} == {"a": None, "b": "image_too_large", "c": None}
    assert got["a"]["image"] == b"image a" and got["c"]["image"] == b"image c"
    assert "104857600 bytes" in got["b"]["reject_message"]
    assert peak < 16 << 20, f"peak Python allocations {peak >> 20} MB"


def test_a_huge_extended_header_is_refused_unread(tmp_path: Path) -> None:
    """A 100 KB .tar.gz whose PAX header declares (and gunzips to) 100 MB: tarfile would hold it
    whole; the shard stops with a clear error after the samples before it, in bounded memory."""
    src = tmp_path / "src"
    src.mkdir()
    good = write_tar(tmp_path / "good.tar", [("a.jpg", b"a")]).read_bytes()[:1024]  # header + data, no EOF
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, 100 << 20
    stream = good + pax.tobuf(tarfile.USTAR_FORMAT) + bytes(100 << 20) + bytes(1024)
    (src / "s.tar.gz").write_bytes(gzip.compress(stream, compresslevel=1))
    spec = SourceSpec("w", "webdataset", str(src))
    got: list[str] = []
    tracemalloc.start()
    try:
        with pytest.raises(tarfile.ReadError, match="extended header of 104857600 bytes"):
            for batch in read_fragment(spec, str(src / "s.tar.gz")):
                got += batch.column("source_key").to_pylist()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak Python allocations {peak >> 20} MB"
    assert got == ["a"]  # what came before the bad header is kept


def test_caption_limit_is_per_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "s.tar", [("a.jpg", b"a"), ("a.txt", b"c" * 300), ("b.jpg", b"b"), ("b.txt", b"short")])
    assert reasons(SourceSpec("w", "webdataset", str(src), max_caption_bytes=100)) == {
        "a": "caption_too_large", "b": None}
    assert reasons(SourceSpec("w", "webdataset", str(src))) == {"a": None, "b": None}


def test_non_utf8_member_name_keeps_the_rest_of_the_shard(tmp_path: Path) -> None:
    bad = b"bad\xff".decode("utf-8", "surrogateescape")
    write_tar(tmp_path / "s.tar", [("a.jpg", b"a"), (f"{bad}.jpg", b"x"), (f"{bad}.txt", b"y"), ("b.jpg", b"b")])
    assert reasons(SourceSpec("w", "webdataset", str(tmp_path))) == {"a": None, "bad\\xff": "bad_name", "b": None}


def test_links_in_a_tar_are_rejects(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        link = tarfile.TarInfo("a.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/proc/self/environ"
        for info, payload in ((tarfile.TarInfo("a.jpg"), b"a"), (link, None), (tarfile.TarInfo("b.jpg"), b"b")):
            info.size = len(payload or b"")
            tar.addfile(info, io.BytesIO(payload) if payload else None)
    assert reasons(SourceSpec("w", "webdataset", str(tmp_path))) == {"a": "not_regular_file", "b": None}


def test_gzip_shards_are_read_and_a_gzip_named_tar_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for number, name in enumerate(("s1.tar.gz", "s2.tgz"), 1):
        plain = write_tar(tmp_path / f"{number}.tar", [(f"{number}.jpg", b"a"), (f"{number}.txt", b"cap a")])
        (src / name).write_bytes(gzip.compress(plain.read_bytes()))
    spec = SourceSpec("w", "webdataset", str(src))
    assert [Path(f).name for f in list_fragments(spec)] == ["s1.tar.gz", "s2.tgz"]
    got = rows(spec)
    assert {k: (r["image"], r["caption"]) for k, r in got.items()} == {"1": (b"a", "cap a"), "2": (b"a", "cap a")}
    shutil.copy(src / "s1.tar.gz", src / "s0.tar")  # gzip under a .tar name: never gunzipped silently
    with pytest.raises(ValueError, match="gzip-compressed but named .tar: rename it .tar.gz"):
        list(read_fragment(spec, str(src / "s0.tar")))


# --- the catalog's limits ----------------------------------------------------------------------------

def test_catalog_limits(tmp_path: Path) -> None:
    entry = {"name": "w", "format": "webdataset", "uri": "w", "max_image_bytes": 1 << 20, "max_caption_bytes": 4096}
    (tmp_path / "sources.yaml").write_text(yaml.safe_dump({"sources": [entry]}))
    spec = load_catalog(tmp_path / "sources.yaml").get("w")
    assert (spec.max_image_bytes, spec.max_caption_bytes) == (1 << 20, 4096)
    (tmp_path / "sources.yaml").write_text(yaml.safe_dump({"sources": [{**entry, "max_image_bytes": None}]}))
    assert load_catalog(tmp_path / "sources.yaml").get("w").max_image_bytes == 64 << 20
    for bad in (0, -1, "64M", 1.5, True):
        (tmp_path / "sources.yaml").write_text(yaml.safe_dump({"sources": [{**entry, "max_caption_bytes": bad}]}))
        with pytest.raises(CatalogError, match="source 'w': field 'max_caption_bytes': must be a positive whole"):
            load_catalog(tmp_path / "sources.yaml")


# --- through the samples stage ------------------------------------------------------------------------

@pytest.mark.usefixtures("ray_cluster")
def test_samples_stage_turns_a_hostile_folder_into_rejects(tmp_path: Path) -> None:
    """The review's folder (`x.gif` and `x.webp`) plus links, a FIFO and an oversized image: the
    source publishes its good samples, every refusal is a reject with its reason, ids are unique."""
    from prx_core.stages.samples.stage import build_samples, count_sample_ids
    from prx_core.store.storage import Storage

    root, outside = tmp_path / "src", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "environ").write_text("AWS_SECRET_ACCESS_KEY=hunter2")
    (root / "x.gif").write_bytes(png(1))  # PIL sniffs the content, not the name
    (root / "x.webp").write_bytes(png(2))
    (root / "x.txt").write_text("two pictures, one caption")
    (root / "env.png").write_bytes(png(3))
    (root / "env.txt").symlink_to(outside / "environ")
    (root / "big.png").write_bytes(png(4) + b"\0" * 4096)
    os.mkfifo(root / "pipe.png")
    bad_folder = os.path.join(os.fsencode(root), b"sub\xff")  # a folder name that is not UTF-8
    os.mkdir(bad_folder)
    with open(os.path.join(bad_folder, b"y.png"), "wb") as handle:
        handle.write(png(5))
    spec = SourceSpec("hostile", "imagefolder", str(root), max_image_bytes=len(png(4)) + 100)
    storage = Storage(str(tmp_path / "corpus"))
    report = build_samples(spec, storage)
    assert report.rows == 2
    assert report.reasons == {"symlink": 1, "not_regular_file": 1, "image_too_large": 1, "bad_name": 1}
    ids = count_sample_ids(storage, "hostile", report.samples_version)
    assert ids.rows == ids.distinct == 2
