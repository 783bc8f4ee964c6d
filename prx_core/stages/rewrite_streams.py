"""`rewrite-stream`: republish a stream without its skipped samples, once skipping costs more than
it saves. The loader substitutes every skipped position with a kept sample of the same stream,
so past ~10% skipped an epoch over-samples the kept ones noticeably (`skip_lists_fraction`
warns); rewriting drops the skipped samples from the shards, leaving an empty skip-list and a
fresh completion record bound to the new index (`prx_core.shards.mds.rewrite`). The same samples are
trained on, each once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prx_core.shards.manifest_publish import publish_source_manifest
from prx_core.shards.mds.rewrite import StreamRewrite, current_record, read_stream_lists, rewrite_stream
from prx_core.shards.mds.streams import StreamKey, list_streams, stream_uri
from prx_core.shards.skiplists.files import stream_key
from prx_core.store.locks import partition_locks
from prx_core.store.names import MERGED
from prx_core.store.storage import Storage

LOCKS = ("mds_shards", "skip_lists")
THRESHOLD = 0.10  # docs/operations.md's and `skip_lists_fraction`'s line


@dataclass(frozen=True)
class StreamSkipped:
    source: str
    key: StreamKey
    size: int
    skipped: int  # union over reasons

    @property
    def name(self) -> str:
        return stream_key(self.source, *self.key)

    @property
    def fraction(self) -> float:
        return self.skipped / self.size if self.size else 0.0


def parse_stream(text: str) -> tuple[str, StreamKey]:
    """`<source>/<tier>/<w>x<h>` (as the loader and the skip-lists name a stream), or its folder
    `<root>/mds/<source>/<tier>/<w>x<h>`: (source, key); ValueError naming the expected form."""
    parts = text.rstrip("/").split("/")
    try:
        source, tier, bucket = parts[-3:]
        width, height = bucket.split("x")
        key = (int(tier), int(width), int(height))
        stream_key(source, *key)  # validates the source name
    except ValueError as exc:
        raise ValueError(f"--stream {text!r}: expected <source>/<tier>/<w>x<h>, e.g. stock_photos/1024/1024x1024") from exc
    return source, key


def skip_fraction(storage: Storage, source: str, key: StreamKey) -> StreamSkipped:
    """The stream's skipped share, from its lists (refused unless its record is for its index)."""
    record = current_record(storage, source, key, stream_uri(storage.root, source, *key))
    lists = read_stream_lists(storage, source, key)
    union = np.unique(np.concatenate([p for p, _ in lists.values()])) if lists else np.empty(0, np.int64)
    return StreamSkipped(source, key, int(record["stream_size"]), len(union))


def streams_over(storage: Storage, threshold: float = THRESHOLD) -> list[StreamSkipped]:
    """Every stream whose skipped share exceeds `threshold`, in stream order: published ones and
    the members of merged streams (a merged stream is rewritten through its members)."""
    found = []
    for uri in list_streams(storage.root, None, storage.storage_options, members=True):
        source, tier, bucket = uri.rstrip("/").rsplit("/", 3)[-3:]
        if source == MERGED:
            continue
        width, height = bucket.split("x")
        skipped = skip_fraction(storage, source, (int(tier), int(width), int(height)))
        if skipped.fraction > threshold:
            found.append(skipped)
    return found


def rewrite_skipped(storage: Storage, source: str, key: StreamKey) -> StreamRewrite:
    """Republish the stream without every position its skip-lists hold, under the source's
    `mds_shards` and `skip_lists` locks."""
    with partition_locks(storage, source, LOCKS, "prx-corpus rewrite-stream"):
        lists = read_stream_lists(storage, source, key)
        drop = np.unique(np.concatenate([p for p, _ in lists.values()])) if lists else np.empty(0, np.int64)
        rewrite = rewrite_stream(storage, source, key, drop)
        publish_source_manifest(storage.root, source, storage.storage_options)
        return rewrite
