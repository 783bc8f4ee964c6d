"""Writing all skip-lists of one source in one process, then publishing its manifest part.

For small corpora, tests and benchmarks; the skip-lists stage writes stream by stream on workers
(`prx_core.stages.skip_lists.stage`). It sits above `prx_core.shards.skiplists.files` (the format, one stream
folder at a time) and `prx_core.shards.manifest_publish`, which reads those files: the writer
lived in `skiplists` and called the publisher back through a lazy import, an import circle.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from prx_core.shards.manifest_publish import publish_source_manifest
from prx_core.shards.mds.streams import list_streams, stream_key_of
from prx_core.shards.skiplists.files import (
    SkipList,
    digest_index,
    remove_stale_streams,
    stream_folder,
    stream_key,
    write_stream_lists,
)
from prx_core.store.names import validate_source_name
from prx_core.store.storage import filesystem_for, join_uri, normalize_root


def write_skip_lists(root: str, source: str, skip_lists: Sequence[SkipList],
                     storage_options: dict | None = None) -> list[str]:
    """Replace all skip-lists of `source` (small corpora, tests; the stage writes stream by stream
    on workers): validated first, then written by (tier, w, h, reason); streams absent lose theirs.
    Every stream of the source published under `root` gets its completion record (for its current
    index.json), whether or not it has a list: the lists given are the whole filter."""
    root = normalize_root(root)
    validate_source_name(source)
    seen: set[tuple[int, int, int, str]] = set()
    by_stream: dict[tuple[int, int, int], list[SkipList]] = {}
    for skip in skip_lists:
        skip.validate()
        if skip.source != source:
            raise ValueError(f"skip-list {skip.stream} {skip.reason!r}: source is not {source!r}")
        if (skip.tier, skip.width, skip.height, skip.reason) in seen:
            raise ValueError(f"skip-list {skip.stream} {skip.reason!r}: given twice")
        seen.add((skip.tier, skip.width, skip.height, skip.reason))
        by_stream.setdefault((skip.tier, skip.width, skip.height), []).append(skip)
    fs = filesystem_for(root, storage_options)
    published = {stream_key_of(uri): uri for uri in list_streams(root, source, storage_options)}
    policy = next((s.policy_version for s in skip_lists), "manual")
    written = []
    for key in sorted(set(by_stream) | set(published)):
        lists = {s.reason: (np.asarray(s.indices, np.int64), pa.array(s.sample_ids, pa.string()))
                 for s in by_stream.get(key, [])}
        header = {"source": source, "tier": key[0], "width": key[1], "height": key[2],
                  "stream": stream_key(source, *key), "policy_version": policy}
        if key in published:
            index = fs.cat_file(join_uri(published[key], "index.json"))
            header.update(stream_size=sum(int(s["samples"]) for s in json.loads(index)["shards"]),
                          index_digest=digest_index(index))
        if key in by_stream:
            first = by_stream[key][0]
            header.update(stream_size=first.stream_size, index_digest=first.index_digest,
                          policy_version=first.policy_version)
        written += write_stream_lists(fs, stream_folder(root, source, *key), header, lists)
    remove_stale_streams(fs, root, source, set(by_stream) | set(published))
    publish_source_manifest(root, source, storage_options)
    return written
