"""The explorer's rows of a unit: one range of the source's content ids in `samples` (or a row
range of its ingest rejects) joined with every table the explorer's pages filter on or show, by
key, through BTREE lookups of the unit's keys.

Every lookup reads the version the stage pinned, so the rows agree with one another; a table not
written yet (no captions, no MDS) leaves its columns null. Skip reasons come from the streams'
skip-list files of the unit's rows (one glob and a few reads per stream it touches), never from a
listing of every skip-list of the corpus.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_core.models.caption_checks import REJECTED, repetition_score
from prx_core.models.caption_keys import caption_keys
from prx_core.shards.skiplists.files import stream_skip_reasons
from prx_core.store import lance_io, schemas
from prx_core.store.lookups import has_verdicts, lookup_keys, table_columns
from prx_core.store.storage import Storage

META_KEY = "label"  # the metadata key whose values the explorer counts and filters (`meta_label`)
MAX_META_VALUE = 200  # characters of a metadata value the `meta` filter accepts; longer ones are not counted
FACET_VALUES = 200  # values per facet a unit counts (the most frequent): summaries stay small
FACETS = ("label", "tier", "bucket", "group", "skipped", "rejected", "meta", "caption", "side", "aspect", "totals")
# The "worst captions" lists: per source, the WORST_CAPTIONS rows at the bad end of each measure
# (sample_id -> the measure), kept in `explorer_facets` so the view reads a few hundred rows.
WORST = {"shortest": "worst_shortest", "longest": "worst_longest", "repetitive": "worst_repetitive",
         "retried": "worst_retried"}
WORST_CAPTIONS = 100
REPETITION_SCALE = 10_000  # a repetition score is counted as an integer of this scale
QUALITY_COLUMNS = {"verdict": "caption_verdict", "problem": "caption_problem", "attempts": "caption_attempts",
                   "captioner_id": "captioner_id"}
SIDE_BINS = 8  # per octave of sqrt(width x height): the overview's resolution histogram, per source
ASPECT_BINS = 16  # per octave of width / height: its aspect-ratio histogram
SAMPLE_COLUMNS = ["sample_id", "content_id", "source", "source_key", "width", "height", "format", "jpeg_quality",
                  "num_bytes", "original_caption"]
REJECT_COLUMNS = ["sample_id", "source", "source_key", "content_id", "stage", "reason", "message", "width", "height"]


def label_expression(schema: pa.Schema) -> dict[str, str]:
    """The projection adding `meta_label` to a `samples` read, where the table has metadata."""
    if "metadata" not in schema.names:
        return {}
    return {"meta_label": f"map_extract(metadata, {lance_io.sql_literal(META_KEY)})"}


def facet_labels(column: pa.ChunkedArray | pa.Array | None, rows: int) -> pa.Array:
    """`meta_label` as one string per row: the key's first value, null where absent, over-long
    (above what the `meta` filter accepts) or holding control characters (which it refuses)."""
    if column is None:
        return pa.nulls(rows, pa.string())
    first = pc.list_element(column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column, 0)
    keep = pc.and_(pc.less_equal(pc.utf8_length(first), MAX_META_VALUE),
                   pc.invert(pc.match_substring_regex(first, r"[\x00-\x1f\x7f]")))
    return pc.if_else(pc.fill_null(keep, False), first, pa.scalar(None, pa.string()))


def sample_base(read: pa.Table) -> pa.Table:
    """The explorer's own columns of `samples` rows read with SAMPLE_COLUMNS (and `metadata`,
    where the table has it): stored, with the metadata's `label` as `meta_label`."""
    labels = facet_labels(pc.map_lookup(read["metadata"], META_KEY, "all") if "metadata" in read.column_names else None,
                          read.num_rows)
    stored = pa.array([True] * read.num_rows, pa.bool_())
    return read.select(SAMPLE_COLUMNS).append_column("stored", stored).append_column("meta_label", labels)


def _first_by(table: pa.Table, key: str) -> pa.Table:
    """One row per `key` (the first): a left join must not multiply the unit's rows."""
    if table.num_rows == 0:
        return table
    index = pa.array(np.arange(table.num_rows))
    firsts = table.append_column("_i", index).group_by(key, use_threads=False).aggregate([("_i", "min")])
    return table.take(np.sort(firsts["_i_min"].to_numpy()))


def _joined(left: pa.Table, right: pa.Table, key: str, columns: Mapping[str, str]) -> pa.Table:
    """`left` with `columns` (right name -> explorer name) of its matching `right` row, in `left`'s order."""
    right = _first_by(right.select([key, *columns]), key).rename_columns([key, *columns.values()])
    out = left.append_column("_order", pa.array(np.arange(left.num_rows)))
    out = out.join(right, key, join_type="left outer", use_threads=False).sort_by("_order")
    return out.drop_columns(["_order"])


def _lookup(storage: Storage, inputs: Mapping[str, int], table: str, key: str, keys: Sequence[str],
            columns: list[str], where: str | None = None) -> pa.Table:
    """Rows of the pinned `table` by `key` (empty, with the columns' types, where it was never written)."""
    version = inputs.get(table)
    if version is None or not keys:
        schema = schemas.TABLES[table]
        return pa.schema([schema.field(c) for c in columns]).empty_table()
    return lookup_keys(storage.lance_uri(table), key, keys, columns, where, storage.lance_storage_options(), version)


def explore_rows(storage: Storage, inputs: Mapping[str, int], base: pa.Table, params: Mapping[str, Any]) -> pa.Table:
    """EXPLORER rows for `base` (sample_id, source, ... with `stored` and `meta_label`): every
    per-sample and per-content table joined by key, and the skip reasons of the stream rows."""
    ids = base["sample_id"].to_pylist()
    rejects = _lookup(storage, inputs, "rejects", "sample_id", ids, ["sample_id", "reason", "stage", "message"])
    rows = _joined(base, rejects, "sample_id", {"reason": "reject_reason", "stage": "reject_stage",
                                                "message": "reject_message"})
    buckets = _lookup(storage, inputs, "buckets", "sample_id", ids, ["sample_id", "tier", "bucket"])
    rows = _joined(rows, buckets, "sample_id", {"tier": "tier", "bucket": "bucket"})
    phashes = _lookup(storage, inputs, "phashes", "sample_id", ids, ["sample_id", "phash"])
    hexes = pa.array([None if h is None else f"{h:016x}" for h in phashes["phash"].to_pylist()], pa.string())
    rows = _joined(rows, pa.table({"sample_id": phashes["sample_id"], "phash": hexes}), "sample_id", {"phash": "phash"})
    near = {"distance": "group_distance", "signature_distance": "group_signature_distance"}
    if inputs.get("duplicates") is not None and "distance" not in table_columns(storage, "duplicates",
                                                                                 inputs["duplicates"]):
        near = {}  # a table grouped before near-duplicates: identical pHashes, no distances
    groups = _lookup(storage, inputs, "duplicates", "sample_id", ids,
                     ["sample_id", "group_id", "group_size", "keeper", "keeper_sample_id", *near],
                     "group_size >= 2")  # a group of one is a kept row its component holds: shown as none
    rows = _joined(rows, groups, "sample_id", {**{c: c for c in ("group_id", "group_size", "keeper", "keeper_sample_id")},
                                               **near})
    captioner, labeler = params["captioner_version"], params["labeler_version"]
    where = f"captioner_version = {lance_io.sql_literal(captioner)}"
    keyed = [None if c is None else k for c, k in zip(rows["content_id"].to_pylist(), caption_keys(
        captioner, [c or "" for c in rows["content_id"].to_pylist()], rows["original_caption"].to_pylist()))]
    rows = rows.append_column("_key", pa.array(keyed, pa.string()))
    keys = [k for k in set(keyed) if k]
    quality = [c for c in QUALITY_COLUMNS if c != "captioner_id"] if inputs.get("captions") is not None and \
        has_verdicts(storage, inputs["captions"]) else []
    captions = _lookup(storage, inputs, "captions", "content_id", keys,
                       ["content_id", "caption", "word_count", "error", "captioner_id", *quality], where)
    rows = _joined(rows, captions.rename_columns(["_key", *captions.column_names[1:]]), "_key",
                   {"caption": "caption", "word_count": "word_count", "error": "caption_error",
                    **{c: QUALITY_COLUMNS[c] for c in ("captioner_id", *quality)}})
    labels = _lookup(storage, inputs, "caption_labels", "content_id", keys, ["content_id", "label", "score"],
                     f"{where} AND labeler_version = {lance_io.sql_literal(labeler)}")
    rows = _joined(rows, labels.rename_columns(["_key", "label", "score"]), "_key", {"label": "label", "score": "score"})
    placed = _lookup(storage, inputs, "mds_index", "sample_id", ids, ["sample_id", "index", "tier", "bucket"])
    rows = _joined(rows, placed.rename_columns(["sample_id", "index", "mds_tier", "mds_bucket"]), "sample_id",
                   {"index": "mds_index", "mds_tier": "mds_tier", "mds_bucket": "mds_bucket"})
    reasons = skip_reasons(storage, rows)
    rows = rows.drop_columns(["mds_tier", "mds_bucket"])
    versions = pa.array([captioner if c is not None else None for c in rows["caption"].to_pylist()], pa.string())
    rows = rows.append_column("captioner_version", versions).append_column("skip_reason", reasons)
    rows = rows.append_column("search_text", search_text(rows["caption"], rows["original_caption"]))
    own_keys = [k if k is not None and k != c else None for k, c in zip(keyed, rows["content_id"].to_pylist())]
    rows = rows.append_column("caption_key", pa.array(own_keys, pa.string()))
    scores = [None if t is None else repetition_score(t) for t in rows["caption"].to_pylist()]
    rows = rows.append_column("caption_repetition", pa.array(scores, pa.float32()))
    for column in QUALITY_COLUMNS.values():
        if column not in rows.column_names:  # a captions table from before the checks
            rows = rows.append_column(column, pa.nulls(rows.num_rows, schemas.EXPLORER.field(column).type))
    return rows.select(schemas.EXPLORER.names).cast(schemas.EXPLORER)


def search_text(caption: pa.ChunkedArray | pa.Array, original: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray:
    """Both captions space-joined, null where neither has text: what the explorer's one full-text index covers.
    (Not `null_handling="skip"`: pyarrow 26 drops the rows where every input is null.)"""
    joined = pc.utf8_trim_whitespace(pc.binary_join_element_wise(caption, original, " ", null_handling="replace",
                                                                  null_replacement=""))
    return pc.if_else(pc.equal(joined, ""), pa.scalar(None, pa.string()), joined)


def skip_reasons(storage: Storage, rows: pa.Table) -> pa.Array:
    """Per row, the sorted skip reasons of its stream position (mds_tier, mds_bucket, mds_index), or null."""
    out: list[list[str]] = [[] for _ in range(rows.num_rows)]
    tiers, buckets = rows["mds_tier"].to_pylist(), rows["mds_bucket"].to_pylist()
    positions = rows["mds_index"].to_numpy(zero_copy_only=False)
    source = rows["source"][0].as_py() if rows.num_rows else ""
    streams: dict[tuple[int, str], list[int]] = {}
    for i, (tier, bucket) in enumerate(zip(tiers, buckets)):
        if tier is not None and bucket is not None:
            streams.setdefault((tier, bucket), []).append(i)
    for (tier, bucket), members in streams.items():
        width, height = (int(v) for v in bucket.split("x"))
        where = np.asarray(members)
        for reason, indices in stream_skip_reasons(storage.root, source, tier, width, height,
                                                   storage.storage_options).items():
            for i in where[np.isin(positions[where].astype(np.int64), indices)]:
                out[i].append(reason)
    return pa.array([",".join(sorted(r)) if r else None for r in out], pa.string())


def size_bins(rows: pa.Table) -> tuple[Counter[str], Counter[str]]:
    """The rows with a size, counted in log-spaced bins of sqrt(w*h) and of w/h (bin i covers
    [2^(i/n), 2^((i+1)/n)) for n bins per octave): the overview's histograms, summed over units."""
    width = rows["width"].to_numpy(zero_copy_only=False).astype(float)
    height = rows["height"].to_numpy(zero_copy_only=False).astype(float)
    sized = (width > 0) & (height > 0)
    width, height = width[sized], height[sized]
    side = np.floor(SIDE_BINS * 0.5 * np.log2(width * height)).astype(int)
    aspect = np.floor(ASPECT_BINS * np.log2(width / height)).astype(int)
    return Counter(map(str, side.tolist())), Counter(map(str, aspect.tolist()))


def count_totals(rows: pa.Table) -> dict[str, int]:
    """Per-source totals the overview shows (rows, rejected, bucketed, in MDS, skipped, duplicates, captioned)."""
    def present(column: str) -> int:
        return rows.num_rows - rows[column].null_count

    keeper = rows["keeper"].to_pylist()
    return {"rows": rows.num_rows, "stored": sum(bool(v) for v in rows["stored"].to_pylist()),
            "rejected": present("reject_reason"), "bucketed": present("bucket"), "in_mds": present("mds_index"),
            "skipped": present("skip_reason"),
            "captioned": present("caption") - sum(v == REJECTED for v in rows["caption_verdict"].to_pylist()),
            "caption_rejected": sum(v == REJECTED for v in rows["caption_verdict"].to_pylist()),
            "duplicates": sum(v is False for v in keeper)}


def worst_captions(rows: pa.Table, top: int = WORST_CAPTIONS) -> dict[str, dict[str, int]]:
    """The "worst captions" lists of these rows (facet -> sample_id -> measure): the `top` shortest
    and longest by words, most repetitive (REPETITION_SCALE x score) and retried (attempts), among
    the rows with a caption."""
    captioned = rows.filter(pc.fill_null(pc.not_equal(rows["caption"], ""), False))
    ids = captioned["sample_id"].to_pylist()
    words = [w or 0 for w in captioned["word_count"].to_pylist()]
    repeated = [round((r or 0) * REPETITION_SCALE) for r in captioned["caption_repetition"].to_pylist()]
    attempts = [a or 0 for a in captioned["caption_attempts"].to_pylist()]
    by_words = sorted(zip(words, ids))
    return {WORST["shortest"]: {s: w for w, s in by_words[:top]},
            WORST["longest"]: {s: w for w, s in sorted(zip(words, ids), key=lambda p: (-p[0], p[1]))[:top]},
            WORST["repetitive"]: {s: r for r, s in sorted(zip(repeated, ids), key=lambda p: (-p[0], p[1]))[:top] if r},
            WORST["retried"]: {s: a for a, s in sorted(zip(attempts, ids), key=lambda p: (-p[0], p[1]))[:top] if a > 1}}


def count_values(column: pa.ChunkedArray | pa.Array, split: bool = False) -> Counter[str]:
    """value (as text) -> rows holding it, nulls and empty values left out; with `split`, each
    value of a comma-joined set counts (skip reasons). Counted in Arrow, not per row in Python."""
    values = column.drop_null()
    if split:
        values = pc.list_flatten(pc.split_pattern(values, ","))
    return Counter({str(c["values"]): c["counts"] for c in pc.value_counts(values).to_pylist() if c["values"] != ""})


def count_facets(rows: pa.Table, top: int = FACET_VALUES) -> dict[str, dict[str, int]]:
    """value -> rows per facet (the `top` most frequent of each; duplicate groups by size, as the
    menu offers the largest). Skip reasons count each reason of a comma-joined set; `side` and
    `aspect` are histogram bins (`size_bins`), `totals` the overview's counts."""
    out = {"label": count_values(rows["label"]), "tier": count_values(rows["tier"]),
           "bucket": count_values(rows["bucket"]), "skipped": count_values(rows["skip_reason"], split=True),
           "rejected": count_values(rows["reject_reason"]), "meta": count_values(rows["meta_label"]),
           "caption": count_values(rows["caption_problem"])}
    groups = count_values(rows["group_id"])
    sizes = dict(zip(rows["group_id"].to_pylist(), rows["group_size"].to_pylist()))
    largest = sorted(groups, key=lambda g: (-(sizes.get(g) or 0), g))[:top]
    side, aspect = size_bins(rows)
    return {**{name: dict(counts.most_common(top)) for name, counts in out.items()},
            "group": {g: groups[g] for g in largest}, "side": dict(side), "aspect": dict(aspect),
            "totals": count_totals(rows), **worst_captions(rows)}


def facet_rows(source: str, counts: Mapping[str, Mapping[str, int]]) -> pa.Table:
    """EXPLORER_FACETS rows of one partition from its summed counts: the FACET_VALUES most frequent
    values of each menu (units count their own top values: at 400 units a source would otherwise
    keep 80,000 duplicate groups), every histogram bin, and every total (a source with no
    duplicates says 0)."""
    def kept(facet: str) -> list[tuple[str, int]]:
        values = counts.get(facet, {})
        if facet in ("side", "aspect", "totals"):
            return sorted(values.items())
        if facet == WORST["shortest"]:  # the bad end is the low one (a 0-word caption counts too)
            return sorted(values.items(), key=lambda p: (p[1], p[0]))[:WORST_CAPTIONS]
        if facet in WORST.values():
            return sorted(values.items(), key=lambda p: (-p[1], p[0]))[:WORST_CAPTIONS]
        return sorted((v, n) for v, n in Counter(values).most_common(FACET_VALUES) if n)

    rows = [{"source": source, "facet": facet, "value": value, "count": int(n)}
            for facet in (*FACETS, *WORST.values()) for value, n in kept(facet)
            if n or facet in ("totals", WORST["shortest"])]
    return pa.Table.from_pylist(rows, schema=schemas.EXPLORER_FACETS)
