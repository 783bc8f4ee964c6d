"""The Ray tasks of a `duplicates` run (prx_core.stages.duplicates.runs wires them), each a layer
whose outputs are split into `buckets` parts in the object store; none returns rows to the driver.

Rows are named by their row address in the pinned `phashes` version (a uint64, the graph's node).
Key entries are (key, node, copy class, changed, colour means) uint64 rows, 40 bytes; pairs and edges are
(node, node); payloads are Arrow tables of `NODE_COLUMNS` with the node as `_node`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.bloom import Bloom
from prx_core.compute.components import both_ways, split_edges
from prx_core.compute.parallel import take_rows
from prx_core.compute.row_units import read_row_units
from prx_core.stages.duplicates.groups import (
    NODE_COLUMNS,
    candidate_pairs,
    colour_means,
    confirmed,
    exact_ids,
    explode_keys,
    keys_of,
    signatures_of,
)
from prx_core.store.lance_io import StorageOptions

NO_ENTRIES = np.empty((0, 5), np.uint64)
NO_PAIRS = np.empty((0, 2), np.uint64)


def gathered(refs: Sequence[Any]) -> list[Any]:
    """In a task: the non-empty parts behind `refs` (fetched here, never by the driver)."""
    import ray

    return [p for p in ray.get(list(refs)) if p is not None and len(p)]


def split_rows(values: np.ndarray, by: np.ndarray, buckets: int) -> tuple[np.ndarray, ...]:
    bucket = np.asarray(by, np.uint64) % np.uint64(buckets)
    return tuple(values[bucket == b] for b in range(buckets))


def _out(parts: tuple[Any, ...]) -> Any:
    return parts if len(parts) > 1 else parts[0]


def key_entries(rows: pa.Table, changed: Sequence[str], bloom: Bloom | None = None, rule: str = "keys") -> np.ndarray:
    """(key, node, copy class, changed, colour means) rows of `rows` (_rowaddr, source, match_keys,
    phash, signature); with `bloom`, only the keys of changed rows and the keys the filter holds.
    Rule "phash": the pHash is the one key, and every pair is a candidate (no colour means)."""
    nodes = np.asarray(rows["_rowaddr"].to_numpy(), np.uint64)
    keys_column = keys_of(rows, rule)
    keys, owners = explode_keys(nodes, keys_column)
    index = np.repeat(np.arange(rows.num_rows), pc.fill_null(pc.list_value_length(keys_column), 0).to_numpy())
    flags = pc.is_in(rows["source"], pa.array(list(changed), pa.string())).to_numpy(zero_copy_only=False)
    flag = flags[index]
    if bloom is not None:
        keep = flag | bloom.contains(keys)
        keys, owners, index, flag = keys[keep], owners[keep], index[keep], flag[keep]
    if not len(keys):
        return NO_ENTRIES
    phash = np.asarray(pc.fill_null(rows["phash"], 0).to_numpy(), np.uint64)
    means = colour_means(signatures_of(rows["signature"])) if rule != "phash" else np.zeros(rows.num_rows, np.uint64)
    return np.column_stack([keys, owners, exact_ids(phash, rows["signature"])[index], flag.astype(np.uint64),
                            means[index]])


def map_units(uri: str, version: int, specs: list[dict], predicate: str, storage_options: StorageOptions,
              buckets: int, changed: list[str], rule: str, bloom: Bloom | None = None) -> Any:
    """Key entries of a group of row units, by key. With a Bloom filter (incremental; Ray passes
    its reference resolved), the keys are read first and only the surviving rows' pHash and
    signature are taken."""
    columns = ["source", "match_keys", "phash"] + ([] if bloom is not None else ["signature"])
    rows = read_row_units(uri, version, specs, columns, predicate, storage_options, with_row_address=True)
    if bloom is not None:
        keys, owners = explode_keys(np.asarray(rows["_rowaddr"].to_numpy(), np.uint64), keys_of(rows, rule))
        wanted = np.isin(rows["_rowaddr"].to_numpy(), owners[bloom.contains(keys)]) | \
            pc.is_in(rows["source"], pa.array(changed, pa.string())).to_numpy(zero_copy_only=False)
        rows = rows.filter(pa.array(wanted))
        extra = take_rows(uri, version, rows["_rowaddr"].to_pylist(), ["signature"], storage_options) \
            if rows.num_rows else pa.table({"signature": pa.array([], pa.binary())})
        rows = rows.append_column("signature", extra["signature"])
    entries = key_entries(rows, changed, bloom, rule)
    return _out(split_rows(entries, entries[:, 0], buckets))


def map_nodes(uri: str, version: int, node_refs: Sequence[Any], storage_options: StorageOptions,
              buckets: int, rule: str) -> Any:
    """Key entries of the rows named by the nodes behind `node_refs` (an incremental run's
    affected rows: node arrays, or pairs), by key."""
    parts = gathered(node_refs)
    nodes = np.unique(np.concatenate([p.ravel() for p in parts])) if parts else np.empty(0, np.uint64)
    rows = take_rows(uri, version, nodes.tolist(), ["source", "match_keys", "phash", "signature"], storage_options) \
        if len(nodes) else None
    if rows is None:
        return _out(tuple(NO_ENTRIES for _ in range(buckets)))
    rows = rows.append_column("_rowaddr", pa.array(nodes, pa.uint64()))
    entries = key_entries(rows, [], rule=rule)
    return _out(split_rows(entries, entries[:, 0], buckets))


def bloom_of_units(uri: str, version: int, specs: list[dict], predicate: str, storage_options: StorageOptions,
                   words: int, rule: str) -> Bloom:
    """The Bloom filter of the keys of a group of row units (the changed sources' rows)."""
    rows = read_row_units(uri, version, specs, ["match_keys", "phash"], predicate, storage_options)
    bloom = Bloom(np.zeros(words, np.uint64))
    bloom.add(pc.list_flatten(keys_of(rows, rule)).to_numpy(zero_copy_only=False))
    return bloom


def pair_bucket(refs: Sequence[Any], buckets: int, changed_only: bool) -> tuple[Any, ...]:
    """Candidate pairs of one key bucket, by first node; and how many keys were left out as too
    common (the last return). `changed_only`: pairs with a changed row only."""
    parts = gathered(refs)
    entries = np.concatenate(parts) if parts else NO_ENTRIES
    pairs, skipped = candidate_pairs(entries[:, 0], entries[:, 1], entries[:, 2], entries[:, 4])
    if changed_only and len(pairs):
        changed = np.unique(entries[entries[:, 3] == 1, 1])
        pairs = pairs[np.isin(pairs[:, 0], changed) | np.isin(pairs[:, 1], changed)]
    return (*split_rows(pairs, pairs[:, 0], buckets), skipped)


def confirm_bucket(refs: Sequence[Any], uri: str, version: int, storage_options: StorageOptions,
                   buckets: int, rule: str) -> tuple[Any, ...]:
    """Confirm one bucket's candidate pairs by their signatures (taken from the pinned version):
    the confirmed edges (both ways, by first node), the payloads of their rows (by node), and
    (last) the counts of pairs seen and confirmed."""
    parts = gathered(refs)
    pairs = np.unique(np.concatenate(parts), axis=0) if parts else NO_PAIRS
    nodes = np.unique(pairs)
    payload = take_rows(uri, version, nodes.tolist(), NODE_COLUMNS, storage_options) if len(nodes) else None
    if payload is None:
        return (*([NO_PAIRS] * buckets), *([None] * buckets), (0, 0))
    sigs = signatures_of(payload["signature"])
    a, b = np.searchsorted(nodes, pairs[:, 0]), np.searchsorted(nodes, pairs[:, 1])
    ok = confirmed(sigs[a], sigs[b])[0] if rule != "phash" else np.ones(len(pairs), bool)
    edges = pairs[ok]
    kept = np.unique(edges)
    payload = payload.append_column("_node", pa.array(nodes, pa.uint64())).filter(pa.array(np.isin(nodes, kept)))
    node_bucket = np.asarray(payload["_node"].to_numpy(), np.uint64) % np.uint64(buckets)
    payloads = tuple(payload.filter(pa.array(node_bucket == b)) for b in range(buckets))
    return (*split_edges(both_ways(edges), buckets), *payloads, (len(pairs), len(edges)))


def label_bucket(labels: np.ndarray, payload_refs: Sequence[Any], buckets: int) -> Any:
    """One node bucket's payloads with their component labels (`_label`; Ray passes the labels'
    reference resolved), by label."""
    tables = gathered(payload_refs)
    if not tables or not len(labels):
        return _out(tuple(None for _ in range(buckets)))
    rows = pa.concat_tables(tables)
    nodes = np.asarray(rows["_node"].to_numpy(), np.uint64)
    first = np.unique(nodes, return_index=True)[1]  # a row confirmed in two buckets arrived twice
    rows = rows.take(pa.array(np.sort(first)))
    nodes = np.asarray(rows["_node"].to_numpy(), np.uint64)
    order = np.argsort(labels[:, 0])
    label = labels[order[np.searchsorted(labels[order, 0], nodes)], 1]
    rows = rows.append_column("_label", pa.array(label, pa.uint64()))
    bucket = label % np.uint64(buckets)
    return _out(tuple(rows.filter(pa.array(bucket == b)) for b in range(buckets)))


def seed_components(node_refs: Sequence[Any], phashes_uri: str, phashes_version: int, table_uri: str,
                    table_version: int, storage_options: StorageOptions, buckets: int) -> Any:
    """The stored components of one bucket of rows a changed source's rows may pair with, by
    component (their whole components are recomputed)."""
    parts = gathered(node_refs)
    nodes = np.unique(np.concatenate(parts)) if parts else np.empty(0, np.uint64)
    ids = take_rows(phashes_uri, phashes_version, nodes.tolist(), ["sample_id"], storage_options)["sample_id"] \
        if len(nodes) else pa.array([], pa.string())
    return _out(split_components(_lookup(table_uri, table_version, storage_options, "sample_id", ids.to_pylist(),
                                         ["component_id"])["component_id"], buckets))


def previous_components(uri: str, version: int, specs: list[dict], predicate: str, storage_options: StorageOptions,
                        buckets: int) -> Any:
    """The components of the changed sources' previous rows, by component."""
    rows = read_row_units(uri, version, specs, ["component_id"], predicate, storage_options)
    return _out(split_components(rows["component_id"], buckets))


def split_components(ids: pa.Array | pa.ChunkedArray, buckets: int) -> tuple[np.ndarray, ...]:
    from prx_core.compute.groupby import parse_hex_ids

    values = np.unique(parse_hex_ids(pc.drop_null(ids))) if len(ids) else np.empty(0, np.uint64)
    return split_rows(values, values, buckets)


def component_members(cid_refs: Sequence[Any], table_uri: str, table_version: int, phashes_uri: str,
                      phashes_version: int, storage_options: StorageOptions, buckets: int) -> tuple[Any, ...]:
    """One bucket of affected components: their rows still in the pinned `phashes` (by node), then
    (last) their stored rows to delete as a table (fragment, component_id)."""
    from prx_core.compute.groupby import hex_ids

    parts = gathered(cid_refs)
    cids = hex_ids(np.unique(np.concatenate(parts))).to_pylist() if parts else []
    stored = _lookup(table_uri, table_version, storage_options, "component_id", cids, ["sample_id", "component_id"],
                     with_row_address=True)
    members = _lookup(phashes_uri, phashes_version, storage_options, "sample_id", stored["sample_id"].to_pylist(),
                      ["sample_id"], with_row_address=True)
    nodes = np.asarray(members["_rowaddr"].to_numpy(), np.uint64)
    deletes = pa.table({"fragment": pa.array(np.asarray(stored["_rowaddr"].to_numpy(), np.uint64) >> np.uint64(32)),
                        "component_id": stored["component_id"]})
    return (*split_rows(nodes, nodes, buckets), deletes)


def _lookup(uri: str, version: int, storage_options: StorageOptions, column: str, values: list[str],
            columns: list[str], with_row_address: bool = False) -> pa.Table:
    import lance

    from prx_core.store.lance_io import sql_literal
    from prx_core.store.lookups import lookup_literals

    ds = lance.dataset(uri, version=version, storage_options=storage_options or None)
    return lookup_literals(ds, column, [sql_literal(v) for v in sorted(set(values))], columns,
                           with_row_address=with_row_address)
