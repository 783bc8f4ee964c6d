"""Small corpora written straight to Lance for the model-stage tests: samples with chosen
content ids and bytes, all bucketed (the bucket rules are tested in test_buckets)."""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

from prx_core.store import schemas
from prx_core.store.partitions import source_predicate, write_partition
from prx_core.store.storage import Storage


def write_contents(storage: Storage, source: str, images: Mapping[str, bytes],
                   captions: Mapping[str, str | None] | None = None, dropped: tuple[str, ...] = ()) -> None:
    """One sample per key (`<source>/<key>`, content_id = key) with the given bytes and source
    caption; every sample bucketed except those of `dropped`."""
    keys = list(images)
    captions = captions or {}
    samples = pa.Table.from_pylist([
        {"sample_id": f"{source}/{k}", "content_id": k, "source": source, "source_key": k, "image": images[k],
         "width": 512, "height": 512, "num_bytes": len(images[k]), "original_caption": captions.get(k)}
        for k in keys], schema=schemas.SAMPLES)
    buckets = pa.Table.from_pylist([
        {"sample_id": f"{source}/{k}", "source": source, "content_id": k, "width": 512, "height": 512,
         **({"drop_reason": "too_small"} if k in dropped else
            {"tier": 512, "bucket_width": 512, "bucket_height": 512, "bucket": "512x512"})}
        for k in keys], schema=schemas.BUCKETS)
    write_partition(storage, "samples", source_predicate(source), samples)
    write_partition(storage, "buckets", source_predicate(source), buckets)


def write_captions(storage: Storage, captioner_version: str, texts: Mapping[str, str], failed: tuple[str, ...] = ()) -> None:
    """`captions` rows for contents (a failed caption for those of `failed`)."""
    from prx_core.store import lance_io

    rows = pa.Table.from_pylist([
        {"content_id": c, "captioner_version": captioner_version, "captioner_id": "test", "prompt_version": "p",
         "caption": "" if c in failed else text, "word_count": len(text.split()),
         "error": "generation_error: test" if c in failed else ""}
        for c, text in texts.items()], schema=schemas.CAPTIONS)
    lance_io.upsert(storage.lance_uri("captions"), rows, ["content_id", "captioner_version"])


def stored_labels(storage: Storage, config, captioner_version: str = "cap-v1") -> pa.Table:
    """Every `caption_labels` row of one (captioner, labeler) pair."""
    from prx_core.store import lance_io

    where = f"captioner_version = '{captioner_version}' AND labeler_version = '{config.version()}'"
    return lance_io.read_table(storage.lance_uri("caption_labels"), filter=where)
