"""Tar shards that used to exhaust memory and CPU under the 1 MiB header cap (issue 23 item 3).

Each archive is built byte by byte here (Python's tarfile cannot write sparse members): an
old-GNU sparse member with a long chain of extension blocks, a PAX sparse 1.0 member whose map
(in its data) claims millions of entries, many global PAX headers, and one large global header
followed by many members. A sparse member is a reject of its sample and the shard goes on; a
shard past the global-header caps is one `unreadable_fragment` (the samples stage's record of
the exception), with the samples read before it kept.
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import pytest
from PIL import Image

from prx_core.sources.catalog import SourceSpec
from prx_core.sources.readers import read_source
from prx_core.sources.tar_headers import MAX_GLOBAL_HEADER_BYTES, MAX_GLOBAL_HEADERS

BLOCK = tarfile.BLOCKSIZE


def jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (400, 400), (30, 160, 90)).save(buffer, "JPEG")
    return buffer.getvalue()


def member(name: str, data: bytes, **pax: str) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    fmt = tarfile.PAX_FORMAT if pax else tarfile.GNU_FORMAT
    info.pax_headers = pax
    return info.tobuf(fmt, "utf-8", "surrogateescape") + data + b"\0" * (-len(data) % BLOCK)


def global_header(payload: dict[str, str]) -> bytes:
    info = tarfile.TarInfo("pax_global_header")
    return info.create_pax_global_header(payload)


def old_gnu_sparse(name: str, data: bytes, extension_blocks: int) -> bytes:
    """A GNUTYPE_SPARSE header whose map continues over `extension_blocks` blocks of 21 entries."""
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")[:BLOCK])
    header[386:386 + 24] = b"%011o\0%011o\0" % (0, len(data))  # one map entry in the header itself
    header[482] = 1  # isextended
    header[483:483 + 12] = b"%011o\0" % 8192  # real size: under the image limit, so only its sparseness refuses it
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    blocks = []
    for i in range(extension_blocks):
        block = bytearray(BLOCK)
        for j in range(21):
            block[j * 24:j * 24 + 24] = b"%011o\0%011o\0" % ((i * 21 + j + 1) * 4096, 512)
        block[504] = 1 if i < extension_blocks - 1 else 0
        blocks.append(bytes(block))
    return bytes(header) + b"".join(blocks) + data + b"\0" * (-len(data) % BLOCK)


def shard(tmp_path: Path, *parts: bytes) -> SourceSpec:
    (tmp_path / "shard-0.tar").write_bytes(b"".join(parts) + b"\0" * (2 * BLOCK))
    return SourceSpec("bombs", "webdataset", str(tmp_path))


def rows(spec: SourceSpec) -> list[dict]:
    return [r for batch in read_source(spec) for r in batch.to_pylist()]


@pytest.mark.parametrize("blocks", [3, 40_000])
def test_an_old_gnu_sparse_member_is_refused_and_the_shard_goes_on(tmp_path: Path, blocks: int) -> None:
    spec = shard(tmp_path, member("a.jpg", jpeg()), old_gnu_sparse("b.jpg", jpeg(), blocks), member("c.jpg", jpeg()))
    if blocks > 64:  # a map chain past the bound: the shard is hostile, what was read before is kept
        with pytest.raises(tarfile.ReadError, match="sparse map of more than 64 extension blocks"):
            list(read_source(spec))
        return
    got = {r["source_key"]: r for r in rows(spec)}
    assert got["a"]["reject_reason"] is None and got["c"]["reject_reason"] is None and got["c"]["image"]
    assert got["b"]["reject_reason"] == "not_regular_file" and "GNU sparse file" in got["b"]["reject_message"]


def test_a_pax_sparse_map_is_never_parsed(tmp_path: Path) -> None:
    """GNU.sparse 1.0 keeps its map in the member data: here it claims 10 million entries
    (tarfile would read and parse them all); refused unread, the next member is still read."""
    sparse_map = b"10000000\n" + b"0\n" * 200_000
    bomb = member("GNUSparseFile.0/b.jpg", sparse_map, **{"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                                                          "GNU.sparse.name": "b.jpg", "GNU.sparse.realsize": "10"})
    spec = shard(tmp_path, member("a.jpg", jpeg()), bomb, member("c.jpg", jpeg()))
    started = time.process_time()
    got = {r["source_key"]: r for r in rows(spec)}
    assert time.process_time() - started < 10  # parsing the whole map took minutes
    assert got["b"]["reject_reason"] == "not_regular_file" and "PAX (GNU.sparse) sparse file" in got["b"]["reject_message"]
    assert got["a"]["image"] and got["c"]["image"] and got["c"]["reject_reason"] is None


def test_global_headers_are_capped_per_shard(tmp_path: Path) -> None:
    many = [global_header({f"k{i}": "v"}) for i in range(MAX_GLOBAL_HEADERS + 1)]
    spec = shard(tmp_path, member("a.jpg", jpeg()), *many, member("c.jpg", jpeg()))
    with pytest.raises(tarfile.ReadError, match=f"at most {MAX_GLOBAL_HEADERS} of"):
        list(read_source(spec))
    big = global_header({f"key{i}": "x" * 100 for i in range(MAX_GLOBAL_HEADER_BYTES // 100)})
    assert len(big) < (1 << 20)  # under the per-header cap: only the per-shard budget refuses it
    with pytest.raises(tarfile.ReadError, match="global PAX headers of"):
        list(read_source(shard(tmp_path, big, *[member(f"m{i}.jpg", jpeg()) for i in range(3)])))


def test_one_small_global_header_as_git_archive_writes_is_fine(tmp_path: Path) -> None:
    spec = shard(tmp_path, global_header({"comment": "0123456789abcdef0123456789abcdef01234567"}),
                 member("a.jpg", jpeg()), member("a.txt", b"a caption"))
    (only,) = rows(spec)
    assert only["source_key"] == "a" and only["caption"] == "a caption" and only["reject_reason"] is None
