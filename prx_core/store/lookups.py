"""What several stages look up for one partition: its eligible contents (bucketed samples,
one address per distinct content), and the captions and labels stored for a model version."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.parallel import scan_partition
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

LOOKUP_BATCH = 5_000


def eligible_contents(source: str, storage: Storage) -> tuple[pa.Table, dict[str, int]]:
    """First sample (address) per distinct content of `source` that reached a bucket."""
    options = storage.lance_storage_options()
    buckets = lance_io.open_table(storage.lance_uri("buckets"), options)
    if buckets is None:
        raise RuntimeError("the buckets table does not exist yet: materialize `buckets` first")
    bucketed = buckets.to_table(columns=["sample_id"], filter=f"{source_predicate(source)} AND tier IS NOT NULL")
    version, samples = scan_partition(storage.lance_uri("samples"), source_predicate(source), ["sample_id", "content_id"], options)
    rows = samples.filter(pc.is_in(samples["sample_id"], bucketed["sample_id"])).sort_by("sample_id")
    first: dict[str, int] = {}
    for cid, address in zip(rows["content_id"].to_pylist(), rows["_rowaddr"].to_pylist()):
        first.setdefault(cid, address)
    table = pa.table({"content_id": list(first), "_rowaddr": pa.array(list(first.values()), pa.uint64())})
    return table, {"samples": version, "buckets": buckets.version}


def read_captions(storage: Storage, captioner_version: str, content_ids: pa.Array) -> tuple[pa.Table, int]:
    dataset = lance_io.open_table(storage.lance_uri("captions"), storage.lance_storage_options())
    if dataset is None:
        raise RuntimeError("the captions table does not exist yet: materialize `captions` first")
    table = dataset.to_table(
        columns=["content_id", "caption"],
        filter=f"captioner_version = {lance_io.sql_literal(captioner_version)} AND error = ''",
    )
    return table.filter(pc.is_in(table["content_id"], content_ids)), dataset.version


def pending_captions(source: str, storage: Storage, captioner_version: str,
                     done: pa.Array) -> tuple[pa.Table, pa.Table, dict[str, int]]:
    """The source's captioned eligible contents, those of them not in `done` (sorted, so batches
    are stable), and the table versions read: what every caption-derived stage starts from."""
    eligible, versions = eligible_contents(source, storage)
    captions, versions["captions"] = read_captions(storage, captioner_version, eligible["content_id"])
    todo = captions.filter(pc.invert(pc.is_in(captions["content_id"], done))).sort_by("content_id")
    return captions, todo, versions


def read_labels(storage: Storage, captioner_version: str, labeler_version: str) -> pa.Table:
    dataset = lance_io.open_table(storage.lance_uri("caption_labels"), storage.lance_storage_options())
    if dataset is None:
        return schemas.CAPTION_LABELS.empty_table()
    where = (f"captioner_version = {lance_io.sql_literal(captioner_version)} "
             f"AND labeler_version = {lance_io.sql_literal(labeler_version)}")
    return dataset.to_table(filter=where)


def lookup_keys(uri: str, key_column: str, keys: Sequence[str], columns: list[str], where: str | None = None,
                storage_options: dict[str, str] | None = None, version: int | None = None,
                batch: int = LOOKUP_BATCH) -> pa.Table:
    """Rows of `uri` whose `key_column` is one of `keys` (and match `where`): a join done by the
    worker that needs it, in IN-list batches a scalar index answers (10,000 keys out of a million
    rows: 0.26 s with a BTREE index on the key), never a scan of the whole shared table per row."""
    ds = lance_io.require_table(uri, storage_options)
    if version is not None:
        ds = ds.checkout_version(version)
    unique = sorted(set(keys))
    parts = []
    for start in range(0, len(unique), batch):
        listed = ", ".join(lance_io.sql_literal(k) for k in unique[start:start + batch])
        condition = f"{key_column} IN ({listed})" + (f" AND ({where})" if where else "")
        parts.append(ds.to_table(columns=columns, filter=condition))
    return pa.concat_tables(parts) if parts else pa.schema([ds.schema.field(c) for c in columns]).empty_table()


def caption_texts(storage: Storage, captioner_version: str, content_ids: Sequence[str],
                  version: int | None = None) -> dict[str, str]:
    """content_id -> caption for the given contents (successful captions of that captioner only)."""
    table = lookup_keys(storage.lance_uri("captions"), "content_id", content_ids, ["content_id", "caption"],
                        f"captioner_version = {lance_io.sql_literal(captioner_version)} AND error = ''",
                        storage.lance_storage_options(), version)
    return dict(zip(table["content_id"].to_pylist(), table["caption"].to_pylist()))
