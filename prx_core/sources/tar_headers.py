"""Tar headers read with bounds: what `tarfile` would otherwise read without limit.

`tarfile` reads a PAX or GNU long-name header's data whole, whatever size it declares; parses a
GNU sparse map without bound (old-GNU extension-block chains, PAX sparse 1.0 maps inside the
member data); and keeps every global PAX header of a shard, applying all of them to each later
member. A 100 KiB `.tar.gz` took 2.7 GiB and 139 s for one row that way. Here:

- an extended header over MAX_HEADER_BYTES ends the shard (one `unreadable_fragment`);
- a sparse member (any GNU sparse flavour) is never expanded: its map is skipped unparsed (an
  old-GNU chain of at most MAX_SPARSE_BLOCKS blocks, else the shard ends) and the member carries a
  `refusal` the reader turns into a reject of its sample, the shard goes on;
- global headers are capped per shard, MAX_GLOBAL_HEADERS of at most MAX_GLOBAL_HEADER_BYTES in
  all (real archives carry one, `git archive`'s ~52-byte comment): past that the shard ends.
"""

from __future__ import annotations

import tarfile

MAX_HEADER_BYTES = 1 << 20  # one PAX or GNU long-name header
MAX_SPARSE_BLOCKS = 64  # old-GNU sparse extension blocks skipped before a shard is judged hostile
MAX_GLOBAL_HEADERS = 16  # per shard
MAX_GLOBAL_HEADER_BYTES = 64 << 10  # per shard, all global headers together
_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
             tarfile.SOLARIS_XHDTYPE)


class BoundedTarInfo(tarfile.TarInfo):
    """`tarinfo=` for `tarfile.open`: the bounds of the module docstring. `refusal` is None for a
    member that may be read, else why its sample is refused."""

    refusal: str | None = None

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED and self.size > MAX_HEADER_BYTES:
            raise tarfile.ReadError(f"extended header of {self.size} bytes (over {MAX_HEADER_BYTES}) "
                                    f"at offset {self.offset}")
        if self.type == tarfile.XGLTYPE:
            count, total = getattr(tarfile_, "_prx_globals", (0, 0))
            count, total = count + 1, total + self.size
            if count > MAX_GLOBAL_HEADERS or total > MAX_GLOBAL_HEADER_BYTES:
                raise tarfile.ReadError(f"{count} global PAX headers of {total} bytes by offset {self.offset} (at "
                                        f"most {MAX_GLOBAL_HEADERS} of {MAX_GLOBAL_HEADER_BYTES} bytes per shard)")
            tarfile_._prx_globals = (count, total)  # type: ignore[attr-defined]
        return super()._proc_member(tarfile_)

    def _proc_sparse(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        """An old-GNU sparse member: its extension blocks skipped, not kept; never expanded."""
        _, extended, real_size = self._sparse_structs  # type: ignore[attr-defined]
        del self._sparse_structs  # type: ignore[attr-defined]
        blocks = 0
        while extended:
            blocks += 1
            block = tarfile_.fileobj.read(tarfile.BLOCKSIZE)
            if blocks > MAX_SPARSE_BLOCKS or len(block) < tarfile.BLOCKSIZE:
                raise tarfile.ReadError(f"sparse member {self.name!r} at offset {self.offset}: a sparse map of more "
                                        f"than {MAX_SPARSE_BLOCKS} extension blocks, or cut short")
            extended = bool(block[504])
        self.sparse = None
        self.refusal = f"a GNU sparse file ({real_size} bytes once expanded): sparse members are refused"
        self.offset_data = tarfile_.fileobj.tell()
        tarfile_.offset = self.offset_data + self._block(self.size)
        self.size = real_size  # what it claims once expanded: the size limits judge that
        return self

    def _refuse_pax_sparse(self, member: tarfile.TarInfo) -> None:
        member.sparse = None
        member.refusal = "a PAX (GNU.sparse) sparse file: sparse members are refused"  # type: ignore[attr-defined]

    def _proc_gnusparse_00(self, next: tarfile.TarInfo, pax_headers: dict, buf: bytes) -> None:  # noqa: A002
        self._refuse_pax_sparse(next)

    def _proc_gnusparse_01(self, next: tarfile.TarInfo, pax_headers: dict) -> None:  # noqa: A002
        self._refuse_pax_sparse(next)

    def _proc_gnusparse_10(self, next: tarfile.TarInfo, pax_headers: dict, tarfile_: tarfile.TarFile) -> None:  # noqa: A002
        self._refuse_pax_sparse(next)  # its map sits in the member data: never read
