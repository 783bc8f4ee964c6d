"""Property-based tests of source key construction (issue 15): keys are unique for distinct files
and members, the same on every rerun, and unchanged where they never collided (compatibility)."""

from __future__ import annotations

import io
import posixpath
import tarfile
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.folders.reader import folder_leaf_keys
from prx_core.sources.readers import read_source, table_key_prefix
from prx_core.sources.tars import member_key

EXTENSIONS = ["jpg", "png", "webp", "txt", "json", "JPG"]
stems = st.text(alphabet="ab.-_", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))
file_names = st.builds(lambda stem, ext: f"{stem}.{ext}", stems, st.sampled_from(EXTENSIONS))
folders = st.lists(st.text(alphabet="ab.", min_size=1, max_size=3).filter(lambda s: s not in (".", "..")),
                   max_size=3).map("/".join)


@settings(max_examples=50)
@given(st.lists(file_names, max_size=12))
def test_folder_keys_unique_and_order_free(names: list[str]) -> None:
    keys = folder_leaf_keys(names)
    assert len(set(keys.values())) == len(keys)
    assert folder_leaf_keys(reversed(names)) == keys == folder_leaf_keys(names + names)
    images = set(keys)
    for name, key in keys.items():
        stem = posixpath.splitext(name)[0]
        unambiguous = sum(posixpath.splitext(n)[0] == stem for n in images) == 1 and stem not in images
        assert key == (stem if unambiguous else name)  # the old key wherever it was already unique


@settings(max_examples=50)
@given(st.dictionaries(folders, st.lists(file_names, max_size=6), max_size=4))
def test_folder_keys_unique_across_folders(tree: dict[str, list[str]]) -> None:
    keys = [posixpath.join(folder, leaf) if folder else leaf
            for folder, names in tree.items() for leaf in folder_leaf_keys(names).values()]
    assert len(keys) == len(set(keys))


@settings(max_examples=30, deadline=None)
@given(st.sets(st.tuples(folders, file_names), max_size=10))
def test_folder_source_keys_unique_and_stable(files: set[tuple[str, str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "src"
        root.mkdir()
        written = set()
        for folder, name in sorted(files):
            path = root / folder / name
            if any(p in written for p in [path, *path.parents]):  # a name already taken by a file
                continue
            if path.exists() or any(p.is_file() for p in path.parents):
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(name.encode())
            written.add(path)
        spec = SourceSpec("f", "imagefolder", str(root))
        first = [r["source_key"] for b in read_source(spec) for r in b.to_pylist()]
        assert len(first) == len(set(first))
        images = [p for p in written if p.suffix.lower().lstrip(".") in ("jpg", "png", "webp")]
        assert len(first) == len(images)  # every image file is one record: nothing lost
        assert [r["source_key"] for b in read_source(spec) for r in b.to_pylist()] == first


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(folders, file_names), max_size=12))
def test_tar_keys_unique_and_stable(members: list[tuple[str, str]]) -> None:
    """Any member sequence (repeats and interleavings included): each key is one sample, later
    groups of a key already given are `duplicate_key` rejects, and a rerun reads the same."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(Path(tmp) / "s.tar", "w") as tar:
            for folder, name in members:
                info = tarfile.TarInfo(posixpath.join(folder, name))
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
        spec = SourceSpec("w", "webdataset", tmp)
        first = [(r["source_key"], r["reject_reason"]) for b in read_source(spec) for r in b.to_pylist()]
        accepted = [key for key, reason in first if reason is None]
        assert len(accepted) == len(set(accepted))
        assert set(accepted) == {member_key(posixpath.join(f, n))[0] for f, n in members}
        assert all(reason in (None, "duplicate_key") for _, reason in first)
        assert [(r["source_key"], r["reject_reason"]) for b in read_source(spec) for r in b.to_pylist()] == first


@settings(max_examples=50)
@given(st.sets(st.tuples(folders, stems), min_size=1, max_size=8), st.integers(0, 3))
def test_parquet_default_keys_unique(files: set[tuple[str, str]], rows: int) -> None:
    root = "s3://bucket/source"
    paths = {posixpath.join(root, folder, f"{stem}.parquet") for folder, stem in files}
    keys = [f"{table_key_prefix(root, path)}:{row}" for path in paths for row in range(rows + 1)]
    assert len(keys) == len(set(keys))
