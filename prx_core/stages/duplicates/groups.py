"""How `duplicates` turns fingerprints into groups, as pure functions on Arrow and NumPy (the runs
in prx_core.stages.duplicates.runs call them on Ray workers; `find_duplicates` chains them in one
process for tests and small sets).

1. **Candidates** (`candidate_pairs`): rows sharing a match key (prx_core.image.fingerprint).
   Rows with the same pHash and signature are one *copy class*: its rows are chained, never paired
   all with all, so 100,000 byte-identical copies of one placeholder cost 100,000 pairs. Classes
   whose colour means rule confirmation out are never paired (`compatible`). A key held by more
   than `max_classes` classes pairs each only with the next `max_classes` in luma order: the
   pairs of a common key grow with its rows, not their square (what is cut is counted).
2. **Confirmation** (`confirmed`): a pair is kept when its signatures are within
   `signature_distance` 1: keys only propose.
3. **Components and groups** (`group_component`): the connected components of confirmed pairs
   (prx_core.compute.components at scale) are cut into groups around keepers, best copy first:
   each row joins the best keeper whose signature it is confirmed with directly, else it keeps
   itself. A chain A~B~C whose ends differ never puts A and C in one group unless both match the
   keeper; a keeper is never a copy confirmed only through another.

The keeper is the copy with the most pixels; among equal sizes a lossless file (PNG, lossless
WebP), then the highest estimated JPEG quality, then the most bytes, then the smallest
`sample_id`, so the choice never depends on read order.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_core.image.fingerprint import CHROMA_LEVELS, MEAN_LEVELS, SIGNATURE_BYTES, signature_distance
from prx_core.image.phash import hamming_many
from prx_core.store import schemas

MAX_CLASSES = 64  # copy classes per key value paired all with all (2,016 pairs); above, each with the next 64
CONFIRM = 1.0  # signature_distance at or below which a candidate pair is the same picture
# what a group needs of each row (PHASHES columns)
NODE_COLUMNS = ["sample_id", "source", "phash", "pixels", "lossless", "jpeg_quality", "num_bytes", "signature"]


def exact_ids(phash: np.ndarray, signatures: pa.Array) -> np.ndarray:
    """A uint64 per row naming its copy class: the pHash mixed with a digest of the signature."""
    digests = np.array([int.from_bytes(hashlib.blake2b(s or b"", digest_size=8).digest(), "big")
                        for s in signatures.to_pylist()], np.uint64)
    return digests ^ np.asarray(phash, np.uint64)


def colour_means(signatures: np.ndarray) -> np.ndarray:
    """A row's mean Y, Cb and Cr, rounded and packed in a uint64 (`compatible` reads it)."""
    s = signatures.astype(np.float32)
    luma, chroma = SIGNATURE_BYTES - 128, 64
    means = np.stack([s[:, :luma].mean(1), s[:, luma:luma + chroma].mean(1), s[:, luma + chroma:].mean(1)], 1)
    packed = np.clip(np.rint(means), 0, 255).astype(np.uint64)
    return packed[:, 0] << np.uint64(16) | packed[:, 1] << np.uint64(8) | packed[:, 2]


def compatible(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether two rows' colour means allow `confirmed` at all: it asks the mean luma within
    MEAN_LEVELS and the chroma within CHROMA_LEVELS on average, so means further apart than that
    (plus a level of rounding each) never confirm. Drops most keys' chance meetings before any
    signature is read."""
    def channel(values: np.ndarray, shift: int) -> np.ndarray:
        return ((values >> np.uint64(shift)) & np.uint64(255)).astype(np.int16)

    return (np.abs(channel(a, 16) - channel(b, 16)) <= MEAN_LEVELS + 1) & \
        (np.abs(channel(a, 8) - channel(b, 8)) <= 2 * CHROMA_LEVELS + 1) & \
        (np.abs(channel(a, 0) - channel(b, 0)) <= 2 * CHROMA_LEVELS + 1)


def candidate_pairs(keys: np.ndarray, nodes: np.ndarray, exact: np.ndarray, means: np.ndarray | None = None,
                    max_classes: int = MAX_CLASSES) -> tuple[np.ndarray, int]:
    """(n, 2) uint64 pairs (smaller node first, unique) of rows sharing a key whose colour means
    are `compatible` (when given), and how many rows of over-common keys found more neighbours
    than they were paired with. A key value held by more than `max_classes` copy classes (a top-8
    set at a billion rows) pairs each class only with the `max_classes` next ones in luma order
    within the luma `compatible` allows: the work stays linear in its rows."""
    if len(keys) == 0:
        return np.empty((0, 2), np.uint64), 0
    means = np.zeros(len(keys), np.uint64) if means is None else means
    order = np.lexsort((nodes, exact, means >> np.uint64(16), keys))  # a copy class's rows share their means
    keys, nodes, exact, means = keys[order], nodes[order], exact[order], means[order]
    new_key = np.r_[True, keys[1:] != keys[:-1]]
    new_class = new_key | np.r_[True, exact[1:] != exact[:-1]]
    pairs = [_chains(nodes, new_class)]
    reps, rep_key = nodes[new_class], np.cumsum(new_key)[new_class]  # one node per class, its key's number
    rep_means = means[new_class]
    starts = np.flatnonzero(np.r_[True, rep_key[1:] != rep_key[:-1]])
    sizes = np.diff(np.r_[starts, len(reps)])
    for size in np.unique(sizes[(sizes >= 2) & (sizes <= max_classes)]):
        first = starts[sizes == size]
        i, j = np.triu_indices(int(size), 1)
        left, right = (first[:, None] + i).ravel(), (first[:, None] + j).ravel()
        keep = compatible(rep_means[left], rep_means[right])
        pairs.append(np.column_stack([reps[left[keep]], reps[right[keep]]]))
    heavy, cut = _windowed(reps, rep_means, starts[sizes > max_classes], sizes[sizes > max_classes], max_classes)
    found = np.concatenate(pairs + heavy)
    found = np.sort(found, axis=1)
    found = found[found[:, 0] != found[:, 1]]
    return (np.unique(found, axis=0) if len(found) else found.reshape(0, 2)), cut


def _windowed(reps: np.ndarray, means: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
              window: int) -> tuple[list[np.ndarray], int]:
    """Pairs of each over-common key's classes (in luma order: the sort put them so) with the next
    `window` classes whose mean luma `compatible` allows; and how many classes had more such
    neighbours than the window holds."""
    luma = ((means >> np.uint64(16)) & np.uint64(255)).astype(np.int16)
    out, cut = [], 0
    for start, size in zip(starts.tolist(), sizes.tolist()):
        y = luma[start:start + size]
        end = np.searchsorted(y, y + MEAN_LEVELS + 1, side="right")  # first class too bright to confirm
        cut += int((end - np.arange(size) - 1 > window).sum())
        for step in range(1, window + 1):
            left = np.flatnonzero(np.arange(size) + step < end)
            if not len(left):
                break
            keep = compatible(means[start + left], means[start + left + step])
            out.append(np.column_stack([reps[start + left[keep]], reps[start + left[keep] + step]]))
    return out, cut


def _chains(nodes: np.ndarray, new_class: np.ndarray) -> np.ndarray:
    """Each row of a copy class with more than one row, paired with the class's first row."""
    first = nodes[np.maximum.accumulate(np.where(new_class, np.arange(len(nodes)), 0))]
    tail = ~new_class
    return np.column_stack([first[tail], nodes[tail]])


def signatures_of(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A binary column of signatures as (n, 384) uint8 (a missing one as zeros: never confirmed,
    since `group_component` and `confirmed` see it differ from every real picture)."""
    values = [s if s is not None and len(s) == SIGNATURE_BYTES else bytes(SIGNATURE_BYTES) for s in column.to_pylist()]
    return np.frombuffer(b"".join(values), np.uint8).reshape(-1, SIGNATURE_BYTES)


def confirmed(sig_a: np.ndarray, sig_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which pairs of signatures are the same picture, and their distances."""
    distance = signature_distance(sig_a, sig_b) if len(sig_a) else np.empty(0, np.float32)
    return distance <= CONFIRM, distance


def keeper_order(rows: pa.Table) -> np.ndarray:
    """Row indices best copy first: pixels, lossless, JPEG quality, bytes, then sample_id."""
    keys = pa.table({"pixels": rows["pixels"], "lossless": pc.fill_null(rows["lossless"], False).cast(pa.int8()),
                     "quality": pc.fill_null(rows["jpeg_quality"].cast(pa.int32()), 0),
                     "bytes": pc.fill_null(rows["num_bytes"], 0), "sample_id": rows["sample_id"]})
    return pc.sort_indices(keys, [("pixels", "descending"), ("lossless", "descending"), ("quality", "descending"),
                                  ("bytes", "descending"), ("sample_id", "ascending")]).to_numpy()


def id_digest(sample_id: str) -> str:
    """16 hex digits naming a group or component by one of its rows."""
    return hashlib.sha256(sample_id.encode()).hexdigest()[:16]


def group_component(rows: pa.Table, confirm: bool = True) -> pa.Table:
    """DUPLICATES rows of one component (NODE_COLUMNS of each of its rows): groups around keepers,
    best copy first; a row confirmed with no better keeper keeps itself (a group of one, kept so
    that a later run sees the whole component). `confirm=False`: one group (the pHash rule)."""
    rows = rows.take(keeper_order(rows))
    sigs = signatures_of(rows["signature"])
    phash = np.asarray(rows["phash"].to_numpy(zero_copy_only=False), np.uint64)
    exact = exact_ids(phash, rows["signature"])
    keepers: list[int] = []
    keeper_of = np.arange(rows.num_rows)
    distance = np.zeros(rows.num_rows, np.float32)
    first_of: dict[int, int] = {}  # copy class -> its first (best) row
    for n in range(rows.num_rows):
        first = first_of.setdefault(int(exact[n]), n)
        if first != n:  # a copy of a row already placed goes where it went
            keeper_of[n], distance[n] = keeper_of[first], distance[first]
            continue
        if keepers and not confirm:
            keeper_of[n], distance[n] = keepers[0], np.nan  # unconfirmed: null in the table
            continue
        if keepers:
            ok, dist = confirmed(np.repeat(sigs[n:n + 1], len(keepers), axis=0), sigs[keepers])
            hits = np.flatnonzero(ok)
            if len(hits):  # keepers are in order: the first hit is the best
                keeper_of[n], distance[n] = keepers[hits[0]], dist[hits[0]]
                continue
        keepers.append(n)
    ids = rows["sample_id"].to_pylist()
    sizes = np.bincount(keeper_of, minlength=rows.num_rows)
    keeper_ids = [ids[k] for k in keeper_of]
    return pa.table({
        "sample_id": rows["sample_id"], "source": rows["source"],
        "group_id": pa.array([id_digest(k) for k in keeper_ids], pa.string()),
        "group_size": pa.array(sizes[keeper_of].astype(np.int32)),
        "keeper": pa.array(keeper_of == np.arange(rows.num_rows)),
        "keeper_sample_id": pa.array(keeper_ids, pa.string()), "pixels": rows["pixels"],
        "component_id": pa.array([id_digest(min(ids))] * rows.num_rows, pa.string()),
        "distance": pa.array(hamming_many(phash, phash[keeper_of]).astype(np.int16)),
        "signature_distance": pa.array(distance, pa.float32(), from_pandas=True),
    }, schema=schemas.DUPLICATES)


def keys_of(rows: pa.Table, rule: str = "keys") -> pa.Array | pa.ChunkedArray:
    """The keys a row is matched by: its match keys, or under the pHash rule its pHash alone."""
    if rule != "phash":
        return rows["match_keys"]
    return pa.array([[] if h is None else [h] for h in rows["phash"].to_pylist()], pa.list_(pa.uint64()))


def explode_keys(nodes: np.ndarray, keys: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(key, node) per match key of each row (a row without keys has none)."""
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    lengths = pc.fill_null(pc.list_value_length(keys), 0).to_numpy()
    flat = np.asarray(pc.list_flatten(keys).to_numpy(zero_copy_only=False), np.uint64)
    return flat, np.repeat(np.asarray(nodes, np.uint64), lengths)


def find_duplicates(phashes: pa.Table, max_classes: int = MAX_CLASSES, rule: str = "keys") -> pa.Table:
    """DUPLICATES rows of PHASHES rows, in one process: what a `duplicates` run computes on Ray."""
    from prx_core.compute.components import local_components

    if phashes.num_rows == 0:
        return schemas.DUPLICATES.empty_table()
    nodes = np.arange(phashes.num_rows, dtype=np.uint64)
    keys, owners = explode_keys(nodes, keys_of(phashes, rule))
    exact = exact_ids(np.asarray(phashes["phash"].to_numpy(zero_copy_only=False), np.uint64), phashes["signature"])
    sigs = signatures_of(phashes["signature"])
    index = owners.astype(np.int64)
    pairs, _ = candidate_pairs(keys, owners, exact[index], colour_means(sigs)[index], max_classes)
    ok = confirmed(sigs[pairs[:, 0].astype(np.int64)], sigs[pairs[:, 1].astype(np.int64)])[0] if rule != "phash" \
        else np.ones(len(pairs), bool)
    labels = local_components(pairs[ok])
    if len(labels) == 0:
        return schemas.DUPLICATES.empty_table()
    order = np.lexsort((labels[:, 0], labels[:, 1]))
    labels = labels[order]
    starts = np.flatnonzero(np.r_[True, labels[1:, 1] != labels[:-1, 1]])
    rows = phashes.select(NODE_COLUMNS)
    parts = [group_component(rows.take(labels[s:e, 0].astype(np.int64)), confirm=rule != "phash")
             for s, e in zip(starts, np.r_[starts[1:], len(labels)])]
    return pa.concat_tables(parts)
