"""Stage `skip_lists`: what training should not see, per stream and reason, without rewriting
shards. Changing the policy re-materializes only this stage.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.shards.skiplists import SkipList, write_skip_lists
from prx_core.store import lance_io
from prx_core.store.lookups import read_labels
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

SKIP_LABELS = ("text", "nsfw")


@dataclass(frozen=True)
class SkipPolicy:
    """Which samples to skip: duplicates that lose to a keeper, labels, explicit opt-outs."""

    duplicates: bool = True
    labels: tuple[str, ...] = SKIP_LABELS
    opt_out: tuple[str, ...] = ()  # source_keys or sample_ids

    def version(self) -> str:
        payload = json.dumps(asdict(self), sort_keys=True)
        return "policy-" + hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclass
class StreamSkips:
    stream: str  # "<tier>/<w>x<h>"
    size: int
    skipped: int  # union over reasons
    by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.skipped / max(self.size, 1)


@dataclass
class SkipReport:
    source: str
    streams: list[StreamSkips]
    files: list[str]
    read_versions: dict[str, int] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(s.size for s in self.streams)

    @property
    def skipped(self) -> int:
        return sum(s.skipped for s in self.streams)


def build_skip_lists(
    source: str, storage: Storage, captioner_version: str, labeler_version: str, policy: SkipPolicy
) -> SkipReport:
    options = storage.lance_storage_options()
    index_table = lance_io.open_table(storage.lance_uri("mds_index"), options)
    if index_table is None:
        raise RuntimeError("the mds_index table does not exist yet: materialize `mds_shards` first")
    index = index_table.to_table(filter=source_predicate(source))
    versions = {"mds_index": index_table.version}
    reasons: dict[str, set[str]] = defaultdict(set)  # reason -> sample_ids
    if policy.duplicates:
        duplicates = lance_io.open_table(storage.lance_uri("duplicates"), options)
        if duplicates is not None:
            losers = duplicates.to_table(columns=["sample_id"], filter=f"{source_predicate(source)} AND NOT keeper")
            reasons["duplicate"] = set(losers["sample_id"].to_pylist())
            versions["duplicates"] = duplicates.version
    if policy.labels:
        labels = read_labels(storage, captioner_version, labeler_version)
        versions["caption_labels"] = lance_io.table_version(storage.lance_uri("caption_labels"), options) or 0
        labels = labels.filter(pc.is_in(labels["label"], pa.array(list(policy.labels))))
        by_content = dict(zip(labels["content_id"].to_pylist(), labels["label"].to_pylist()))
        for sid, cid in zip(index["sample_id"].to_pylist(), index["content_id"].to_pylist()):
            if cid in by_content:
                reasons[by_content[cid]].add(sid)
    if policy.opt_out:
        wanted = set(policy.opt_out)
        reasons["opt_out"] = {sid for sid in index["sample_id"].to_pylist()
                              if sid in wanted or sid.split("/", 1)[1] in wanted}
    lists, streams = [], []
    by_stream: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for row in index.to_pylist():
        by_stream[(row["tier"], row["bucket"])].append(row)
    for (tier, bucket), rows in sorted(by_stream.items()):
        width, height = (int(v) for v in bucket.split("x"))
        rows.sort(key=lambda r: r["index"])
        union: set[int] = set()
        counts: dict[str, int] = {}
        for reason, ids in sorted(reasons.items()):
            hits = [r for r in rows if r["sample_id"] in ids]
            if not hits:
                continue
            lists.append(SkipList(source, tier, width, height, reason, policy.version(),
                                  tuple(r["index"] for r in hits), tuple(r["sample_id"] for r in hits), len(rows)))
            counts[reason] = len(hits)
            union.update(r["index"] for r in hits)
        streams.append(StreamSkips(f"{tier}/{bucket}", len(rows), len(union), counts))
    files = write_skip_lists(storage.root, source, lists, storage.storage_options)
    return SkipReport(source, streams, files, versions)
