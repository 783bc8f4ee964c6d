"""Arrow schemas of the corpus tables under `<root>/lance/`.

One place for the columns every stage reads and writes, so a reader (the explorer, the loader, a
notebook) and the writer never disagree. Tables keyed by `sample_id` carry `source`, the
partition key their rows are replaced by; tables keyed by `content_id` are shared by sources.
"""

from __future__ import annotations

import pyarrow as pa

# What `duplicates` needs of a picture besides its pHash (prx_core.image.fingerprint): the keys that
# find its copies, the signature that confirms them, and whether the file is lossless (the keeper's tie-break).
FINGERPRINT = [
    ("match_keys", pa.list_(pa.uint64())),
    ("signature", pa.binary()),  # 16x16 luma and 8x8 chroma, 384 bytes
    ("lossless", pa.bool_()),
]

SAMPLES = pa.schema(
    [
        ("sample_id", pa.string()),
        ("content_id", pa.string()),  # SHA-256 of the source bytes
        ("source", pa.string()),
        ("source_key", pa.string()),
        ("image", pa.large_binary()),
        ("width", pa.int32()),  # after EXIF orientation
        ("height", pa.int32()),
        ("format", pa.string()),
        ("mode", pa.string()),
        ("orientation", pa.int8()),
        ("jpeg_quality", pa.int16()),  # estimated; null for other formats
        ("num_bytes", pa.int64()),
        ("original_caption", pa.string()),
        ("embedding", pa.list_(pa.float32())),
        # added after the first release: last, so an older table gains it as a null column
        ("phash", pa.uint64()),  # 64-bit DCT pHash, from the ingest decode (the `phashes` stage copies it)
        ("metadata", pa.map_(pa.string(), pa.string())),  # per-sample source metadata: label, license, width, ...
        ("source_url", pa.string()),  # a fetched image's URL (url_column sources), else null
        *FINGERPRINT,  # from the ingest decode; null in rows ingested before (the `phashes` stage fills them in)
    ]
)

REJECTS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("source_key", pa.string()),
        ("content_id", pa.string()),
        ("stage", pa.string()),
        ("reason", pa.string()),
        ("message", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
    ]
)

PHASHES = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("phash", pa.uint64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("pixels", pa.int64()),
        ("jpeg_quality", pa.int16()),  # keeper tie-breaks: lossless, then quality, then size in bytes
        ("num_bytes", pa.int64()),
        *FINGERPRINT,
    ]
)

BUCKETS = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("content_id", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("tier", pa.int32()),  # null when dropped
        ("bucket_width", pa.int32()),
        ("bucket_height", pa.int32()),
        ("bucket", pa.string()),  # "<w>x<h>", the MDS stream folder
        ("drop_reason", pa.string()),  # null when bucketed
    ]
)

DUPLICATES = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("group_id", pa.string()),  # 16 hex digits of the keeper's sample_id digest (stage duplicates)
        ("group_size", pa.int32()),
        ("keeper", pa.bool_()),
        ("keeper_sample_id", pa.string()),
        ("pixels", pa.int64()),
        # added with near-duplicates: the component of confirmed pairs the group was cut from (16 hex
        # digits of its smallest sample_id's digest), and how far the member is from its keeper
        ("component_id", pa.string()),
        ("distance", pa.int16()),  # pHash Hamming distance to the keeper (0 for the keeper)
        ("signature_distance", pa.float32()),  # prx_core.image.fingerprint: <= 1 confirmed (0: the keeper; null: the
        # pHash rule, unconfirmed)
    ]
)

CAPTIONS = pa.schema(
    [
        ("content_id", pa.string()),
        ("captioner_version", pa.string()),  # with content_id, the key
        ("captioner_id", pa.string()),
        ("prompt_version", pa.string()),
        ("caption", pa.string()),
        ("word_count", pa.int32()),
        ("error", pa.string()),  # "" when captioned; failures are retried on the next run
        # added after the first release: last, so an older table gains them as null columns
        # (null verdict: stored before the checks existed; the next captions run checks it)
        ("verdict", pa.string()),  # ok | retried | rejected (never shipped) | flagged (a source caption); "" failed
        ("problem", pa.string()),  # the check that refused or flagged it (prx_core.models.caption_checks)
        ("finish_reason", pa.string()),  # why generation stopped: stop | length (the token cap); "" unknown
        ("attempts", pa.int32()),  # generations made: 2 when retried with the fallback decoding; 0 for a source caption
        ("image_content_id", pa.string()),  # a source caption's content (its key is not the content); null otherwise
    ]
)

CAPTION_LABELS = pa.schema(
    [
        ("content_id", pa.string()),
        ("captioner_version", pa.string()),  # the caption the label was computed from
        ("labeler_version", pa.string()),
        ("labeler_id", pa.string()),
        ("label", pa.string()),
        ("score", pa.float32()),
    ]
)

CAPTION_EMBEDDING_DIM = 384  # all-MiniLM-L6-v2 (prx_core.models.embeddings)

CAPTION_EMBEDDINGS = pa.schema(
    [
        ("content_id", pa.string()),
        ("captioner_version", pa.string()),  # the caption the vector was computed from
        ("embedder_version", pa.string()),  # with the two above, the key
        ("embedder_id", pa.string()),
        ("embedding", pa.list_(pa.float32(), CAPTION_EMBEDDING_DIM)),  # unit-norm; vector index `embedding_vector`
    ]
)

TEXT_LATENTS = pa.schema(
    [
        ("content_id", pa.string()),
        ("captioner_version", pa.string()),  # the caption the latent was computed from
        ("encoder_version", pa.string()),  # with the two above, the key
        ("encoder_id", pa.string()),
        ("tokens", pa.int32()),  # the caption's tokens (the mask's ones, a prefix: right padding)
        ("hidden", pa.int32()),
        ("latent", pa.large_binary()),  # bfloat16 bits, C order [rows, hidden]: rows = tokens with masks, else max_tokens
    ]
)


def source_embeddings_schema(dim: int) -> pa.Schema:
    """`source_embeddings` holds the sources' own (CLIP) vectors, `dim` wide: the dimension of the
    first source written; a source of another dimension is reported, never mixed in."""
    return pa.schema(
        [
            ("sample_id", pa.string()),
            ("source", pa.string()),
            ("content_id", pa.string()),
            ("embedding", pa.list_(pa.float32(), dim)),  # as the source gave it; vector index `embedding_vector`
        ]
    )


SOURCE_EMBEDDINGS = source_embeddings_schema(512)  # the demo's dimension; a corpus fixes its own

MDS_INDEX = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("content_id", pa.string()),
        ("tier", pa.int32()),
        ("bucket", pa.string()),
        ("index", pa.int64()),  # position within the stream, what skip-lists refer to
        ("image_sha256", pa.string()),  # of the stored JPEG bytes
        ("captioner_version", pa.string()),
    ]
)

# The explorer's own tables (prx_core.stages.explorer.stage): one denormalized row per sample or ingest
# reject of a source, the columns its pages filter on and show, so a page is one filtered Lance scan
# with a limit, never a join of corpus-sized tables in the explorer's memory.
EXPLORER = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("source_key", pa.string()),
        ("content_id", pa.string()),  # null for an ingest reject that was never read
        ("stored", pa.bool_()),  # a `samples` row holds its bytes (false: an ingest reject)
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("format", pa.string()),
        ("jpeg_quality", pa.int16()),
        ("num_bytes", pa.int64()),
        ("meta_label", pa.string()),  # metadata's `label` value, where short and printable
        ("original_caption", pa.string()),
        ("reject_reason", pa.string()),
        ("reject_stage", pa.string()),
        ("reject_message", pa.string()),
        ("tier", pa.int32()),
        ("bucket", pa.string()),
        ("phash", pa.string()),  # 16 hex digits
        ("group_id", pa.string()),
        ("group_size", pa.int32()),
        ("keeper", pa.bool_()),
        ("keeper_sample_id", pa.string()),
        ("captioner_version", pa.string()),  # the caption shown: the version mds_shards writes
        ("caption", pa.string()),
        ("word_count", pa.int32()),
        ("caption_error", pa.string()),
        ("label", pa.string()),
        ("score", pa.float32()),
        ("mds_index", pa.int64()),
        ("skip_reason", pa.string()),  # the stream's skip reasons for it, sorted and comma-joined
        # caption and original caption, space-joined: the one full-text index the search reads. Lance
        # keeps every indexed row's length in memory per INVERTED index (~12 B a row: 1.2 GB at 100M
        # rows), so one index over both captions holds that once, not twice.
        ("search_text", pa.string()),
        # added after the first release: last, so an older table gains them as null columns
        ("caption_key", pa.string()),  # the caption's key where it is not the content (the `source` captioner's)
        ("captioner_id", pa.string()),  # what produced the caption: "source", or "<backend>:<model>:<version>"
        ("caption_verdict", pa.string()),  # the caption checks': ok | retried | rejected | flagged
        ("caption_problem", pa.string()),  # the check that refused, retried or flagged it (a filter menu)
        ("caption_attempts", pa.int32()),  # generations made (2: retried with the fallback decoding)
        ("caption_repetition", pa.float32()),  # 0..1, the explorer's "most repetitive" (caption_checks)
        ("group_distance", pa.int16()),  # duplicates: pHash Hamming distance to the group's keeper
        ("group_signature_distance", pa.float32()),  # duplicates: signature distance to the keeper (<= 1 confirmed)
    ]
)

# The explorer's filter menus, counted per partition when its rows are written: (facet, value) -> rows.
EXPLORER_FACETS = pa.schema(
    [
        ("source", pa.string()),
        ("facet", pa.string()),  # label | tier | bucket | group | skipped | rejected | meta
        ("value", pa.string()),
        ("count", pa.int64()),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "samples": SAMPLES,
    "rejects": REJECTS,
    "phashes": PHASHES,
    "buckets": BUCKETS,
    "duplicates": DUPLICATES,
    "captions": CAPTIONS,
    "caption_labels": CAPTION_LABELS,
    "caption_embeddings": CAPTION_EMBEDDINGS,
    "text_latents": TEXT_LATENTS,
    "source_embeddings": SOURCE_EMBEDDINGS,
    "mds_index": MDS_INDEX,
    "explorer": EXPLORER,
    "explorer_facets": EXPLORER_FACETS,
}


# Tables replaced partition by partition, and the columns of a partition's key: compaction keeps
# each key's rows in fragments of their own (prx_core.upkeep.compaction). The others are shared
# (upserted by content) or global (`duplicates`).
PARTITION_COLUMNS: dict[str, list[str]] = {
    "samples": ["source"], "buckets": ["source"], "phashes": ["source"], "source_embeddings": ["source"],
    "mds_index": ["source"], "rejects": ["source", "stage"], "explorer": ["source"], "explorer_facets": ["source"],
}
# Low-cardinality columns the explorer filters and counts by: BITMAP indexes beside the partition's.
FILTER_COLUMNS: dict[str, list[str]] = {"explorer": ["label", "tier", "bucket", "reject_reason", "skip_reason",
                                                    "caption_problem"]}
# The other indexes tables keep (prx_core.store.maintenance.refresh_table_indexes; the partition
# columns get BITMAP indexes, so a partition's rows are found without scanning the table: 40 ms
# -> 0.4 ms at 2M rows): full-text for the explorer's search, vectors for "more like this".
FTS_COLUMNS: dict[str, list[str]] = {"samples": ["original_caption"], "captions": ["caption"],
                                     "explorer": ["search_text"]}
# Indexes a table no longer keeps, dropped by refresh_table_indexes where an older corpus has them
# (Lance would otherwise extend them at every commit): the explorer searched each caption on its own.
RETIRED_INDEXES: dict[str, list[str]] = {"explorer": ["caption_fts", "original_caption_fts"]}
# BTREE indexes on the keys other stages look rows up by, a batch of keys at a time (IN-lists in
# prx_core.store.lookups): a partition's captions, labels and vectors by content_id, the other
# samples of a content by content_id (which unit owns it; a content unit reads its range of
# content ids from `samples` and `buckets`: prx_core.compute.key_ranges), the members of a pHash group by phash,
# losing duplicates by sample_id and a group's rows by group_id, a unit's rows of every per-sample
# table by sample_id (the explorer's rows), an explorer page's sample or group, without scanning.
BTREE_COLUMNS: dict[str, list[str]] = {"samples": ["sample_id", "content_id"], "rejects": ["sample_id"],
                                       "captions": ["content_id"], "caption_labels": ["content_id"],
                                       "caption_embeddings": ["content_id"], "text_latents": ["content_id"],
                                       "buckets": ["content_id", "sample_id"], "mds_index": ["sample_id"],
                                       "phashes": ["phash", "sample_id"], "source_embeddings": ["sample_id"],
                                       "duplicates": ["sample_id", "group_id", "component_id"],
                                       "explorer": ["sample_id", "content_id", "group_id", "caption_key"]}
VECTOR_COLUMNS: dict[str, str] = {"caption_embeddings": "embedding", "source_embeddings": "embedding"}


def sample_id(source: str, source_key: str) -> str:
    """Stable across reruns and readable in the explorer: `<source>/<source_key>`."""
    return f"{source}/{source_key}"


def table_of(columns: dict[str, object], schema: pa.Schema) -> pa.Table:
    """`columns` as a table of `schema`, the columns it lacks as nulls: what a writer that predates a
    column (or synthetic data that does not model it) stores."""
    rows = len(next(iter(columns.values())))
    return pa.table({f.name: columns[f.name] if f.name in columns else pa.nulls(rows, f.type) for f in schema}).cast(schema)
