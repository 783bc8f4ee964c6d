"""Verify published streams in parallel: one Ray task per shard (`mds_read.verify_shard`), the
expected image hashes read by the task from its chunk's record, the driver adding up counts and
a bounded list of problems. What the `mds_shards` check runs before anyone trains."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow.compute as pc

from prx_core.compute.parallel import imap_tasks
from prx_core.shards.mds import read_chunk_record
from prx_core.shards.mds_read import read_index, verify_shard
from prx_core.store.storage import join_uri

MAX_PROBLEMS = 50


@dataclass
class VerifyReport:
    streams: int = 0
    shards: int = 0
    samples: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # stream uri -> samples read back
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_streams(uris: list[str], storage_options: dict | None = None, quality: int | None = 92,
                   max_in_flight: int | None = None) -> VerifyReport:
    """Read every shard of the published streams `uris` back on workers."""
    report = VerifyReport(streams=len(uris))

    def calls():
        for uri in uris:
            offsets: dict[str, int] = {}
            for info in read_index(uri, storage_options)["shards"]:
                chunk = info["raw_data"]["basename"].split("/", 1)[0]
                start = offsets.get(chunk, 0)
                offsets[chunk] = start + int(info["samples"])
                yield uri, info, chunk, start, storage_options, quality

    for _, (uri, count, problems) in imap_tasks(_verify, calls(), max_in_flight=max_in_flight):
        report.shards += 1
        report.samples += count
        report.counts[uri] = report.counts.get(uri, 0) + count
        report.problems += [f"{uri}: {p}" for p in problems][:MAX_PROBLEMS - len(report.problems)]
    return report


def _verify(uri: str, info: dict, chunk: str, start: int, storage_options: dict | None,
            quality: int | None) -> tuple[str, int, list[str]]:
    """Ray task: one shard against its chunk's record (stored samples, in order)."""
    record = read_chunk_record(join_uri(uri, chunk), storage_options).filter(pc.field("reason").is_null())
    expected = record["image_sha256"].to_pylist()[start:start + int(info["samples"])]
    shard = verify_shard(uri, info, storage_options, expected_sha256=expected, expected_quality=quality)
    return uri, shard.count, shard.problems
