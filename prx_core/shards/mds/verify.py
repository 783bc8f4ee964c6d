"""Verify published streams in parallel: one Ray task per chunk, its shards checked against the
image hashes of the chunk's record (read once per chunk, not once per shard, and counted in the
bytes read), the driver adding up counts, bytes read and a bounded list of problems. What the
`mds_shards` check runs before anyone trains.

By default a shard is read back within a budget (`sampled_read.verify_shard_sample`: its size,
its header, a few samples by byte range); `sample_rows=None` reads every shard whole and decodes
every image (`read.verify_shard`), what a full audit or a test wants."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow.compute as pc

from prx_core.compute.parallel import imap_tasks
from prx_core.shards.mds.read import read_index, verify_shard
from prx_core.shards.mds.sampled_read import SAMPLE_ROWS, verify_shard_sample
from prx_core.shards.mds.streams import CHUNK_RECORD, read_chunk_record
from prx_core.store.storage import filesystem_for, join_uri

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

    def calls():  # one task per chunk: its record is read once for all of its shards
        for uri in uris:
            chunks: dict[str, list[tuple[dict, int]]] = {}
            for info in read_index(uri, storage_options)["shards"]:
                shards = chunks.setdefault(info["raw_data"]["basename"].split("/", 1)[0], [])
                shards.append((info, sum(int(i["samples"]) for i, _ in shards)))
            for chunk, shards in chunks.items():
                yield uri, chunk, shards, storage_options, quality, sample_rows

    for _, (uri, shards, record_bytes) in imap_tasks(_verify_chunk, calls(), max_in_flight=max_in_flight):
        report.bytes_read += record_bytes
        for count, problems, read, published in shards:
            report.shards += 1
            report.samples += count
            report.bytes_read += read
            report.bytes_published += published
            report.counts[uri] = report.counts.get(uri, 0) + count
            report.problems += [f"{uri}: {p}" for p in problems][:MAX_PROBLEMS - len(report.problems)]
    return report


def _verify_chunk(uri: str, chunk: str, shards: list[tuple[dict, int]], storage_options: dict | None,
                  quality: int | None, sample_rows: int | None) -> tuple[str, list[tuple[int, list[str], int, int]], int]:
    """Ray task: the shards of one chunk (with their first sample's position in it) against the
    chunk's record (stored samples, in order); with the record's own bytes, which a read-back reads too."""
    folder = join_uri(uri, chunk)
    record = read_chunk_record(folder, storage_options).filter(pc.field("reason").is_null())
    record_bytes = int(filesystem_for(folder, storage_options).size(join_uri(folder, CHUNK_RECORD)))
    hashes = record["image_sha256"].to_pylist()
    results = []
    for info, start in shards:
        expected = hashes[start:start + int(info["samples"])]
        published = int(info["raw_data"]["bytes"])
        if sample_rows is None:
            shard = verify_shard(uri, info, storage_options, expected_sha256=expected, expected_quality=quality)
            results.append((shard.count, shard.problems, published, published))
        else:
            shard, read = verify_shard_sample(uri, info, storage_options, expected, quality, sample_rows)
            results.append((shard.count, shard.problems, read, published))
    return uri, results, record_bytes
