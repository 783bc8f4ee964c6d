"""Stage `duplicates` (global): groups of identical pHash across every source.

Hamming distance 0 only: the pHash is computed from a canonical reduced image so that
re-encodes and resizes of one picture collide exactly, and exact grouping is a sort, not an
all-pairs search, at a billion rows. The keeper is the copy with the most pixels; among equal
sizes the highest estimated JPEG quality (lossless formats count as 100), then the most bytes,
then the smallest `sample_id`, so the choice never depends on read order.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from prx_core.store import lance_io, maintenance, schemas
from prx_core.store.storage import Storage


@dataclass
class DuplicatesReport:
    rows_read: int
    groups: int
    duplicates: int  # samples that lose to a keeper
    phashes_version: int
    duplicates_version: int

    @property
    def duplicate_rate(self) -> float:
        return self.duplicates / max(self.rows_read, 1)


def find_duplicates(phashes: pa.Table) -> pa.Table:
    """DUPLICATES rows (members of groups of two or more) from PHASHES rows."""
    groups: dict[int, list[dict]] = {}
    for row in phashes.select(["sample_id", "source", "phash", "pixels", "jpeg_quality", "num_bytes"]).to_pylist():
        groups.setdefault(row["phash"], []).append(row)
    out: list[dict] = []
    for value, members in sorted(groups.items()):
        if len(members) < 2:
            continue
        members.sort(key=keeper_order)
        keeper = members[0]["sample_id"]
        for member in members:
            out.append({"sample_id": member["sample_id"], "source": member["source"], "group_id": f"{value:016x}",
                        "group_size": len(members), "keeper": member["sample_id"] == keeper,
                        "keeper_sample_id": keeper, "pixels": member["pixels"]})
    return pa.Table.from_pylist(out, schema=schemas.DUPLICATES)


def keeper_order(row: dict) -> tuple:
    quality = 100 if row["jpeg_quality"] is None else row["jpeg_quality"]
    return (-row["pixels"], -quality, -(row["num_bytes"] or 0), row["sample_id"])


def build_duplicates(storage: Storage) -> DuplicatesReport:
    options = storage.lance_storage_options()
    phashes = lance_io.open_table(storage.lance_uri("phashes"), options)
    if phashes is None:
        raise RuntimeError("the phashes table does not exist yet: materialize `phashes` first")
    table = phashes.to_table(columns=["sample_id", "source", "phash", "pixels", "jpeg_quality", "num_bytes"])
    duplicates = find_duplicates(table)
    lance_io.overwrite(storage.lance_uri("duplicates"), duplicates, options)
    version = maintenance.refresh_table_indexes(storage.lance_uri("duplicates"), "duplicates", options).version
    losers = int(duplicates.num_rows - sum(duplicates["keeper"].to_pylist()))
    groups = len(set(duplicates["group_id"].to_pylist()))
    return DuplicatesReport(table.num_rows, groups, losers, phashes.version, version)
