"""Verify published streams in parallel: one Ray task per shard, the expected image hashes read by
the task from its chunk's record, the driver adding up counts, bytes read and a bounded list of
problems. What the `mds_shards` check runs before anyone trains.

By default a shard is read back within a budget (`sampled_read.verify_shard_sample`: its size,
its header, a few samples by byte range); `sample_rows=None` reads every shard whole and decodes
every image (`mds_read.verify_shard`), what a full audit or a test wants."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow.compute as pc

from prx_core.compute.parallel import imap_tasks
from prx_core.shards.mds import read_chunk_record
from prx_core.shards.mds_read import read_index, verify_shard
from prx_core.shards.sampled_read import SAMPLE_ROWS, verify_shard_sample
from prx_core.store.storage import join_uri

MAX_PROBLEMS = 50


@dataclass
class VerifyReport:
    streams: int = 0
    shards: int = 0
    samples: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # stream uri -> samples read back
    problems: list[str] = field(default_factory=list)
    bytes_read: int = 0  # what the read-back fetched
    bytes_published: int = 0  # what the shards hold
    sample_rows: int | None = None  # samples checked per shard; None: every one

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_streams(uris: list[str], storage_options: dict | None = None, quality: int | None = 92,
                   max_in_flight: int | None = None, sample_rows: int | None = SAMPLE_ROWS) -> VerifyReport:
    """Read every shard of the published streams `uris` back on workers (`sample_rows` of each,
    or all of it)."""
    report = VerifyReport(streams=len(uris), sample_rows=sample_rows)

    def calls():
        for uri in uris:
            offsets: dict[str, int] = {}
            for info in read_index(uri, storage_options)["shards"]:
                chunk = info["raw_data"]["basename"].split("/", 1)[0]
                start = offsets.get(chunk, 0)
                offsets[chunk] = start + int(info["samples"])
                yield uri, info, chunk, start, storage_options, quality, sample_rows

    for _, (uri, count, problems, read, published) in imap_tasks(_verify, calls(), max_in_flight=max_in_flight):
        report.shards += 1
        report.samples += count
        report.bytes_read += read
        report.bytes_published += published
        report.counts[uri] = report.counts.get(uri, 0) + count
        report.problems += [f"{uri}: {p}" for p in problems][:MAX_PROBLEMS - len(report.problems)]
    return report


def _verify(uri: str, info: dict, chunk: str, start: int, storage_options: dict | None, quality: int | None,
            sample_rows: int | None) -> tuple[str, int, list[str], int, int]:
    """Ray task: one shard against its chunk's record (stored samples, in order)."""
    record = read_chunk_record(join_uri(uri, chunk), storage_options).filter(pc.field("reason").is_null())
    expected = record["image_sha256"].to_pylist()[start:start + int(info["samples"])]
    published = int(info["raw_data"]["bytes"])
    if sample_rows is None:
        shard = verify_shard(uri, info, storage_options, expected_sha256=expected, expected_quality=quality)
        return uri, shard.count, shard.problems, published, published
    shard, read = verify_shard_sample(uri, info, storage_options, expected, quality, sample_rows)
    return uri, shard.count, shard.problems, read, published
