"""`prx-corpus plan`: what building a source will cost, measured on a sample before a backfill.

Per source, a sample of its images (`sample`, default 1,000) is read from up to `FRAGMENTS`
fragments spread over the source (Ray tasks on a cluster, threads here), and each image goes
through what the stages will do to it: the validating decode of `samples` (`inspect_image`),
the bucket, and the render of `mds_shards` (`process_image(facts=False)`), timed in CPU seconds.
The source's size comes from metadata where the format has it (parquet footers, Lance), from the
sample itself when it read every record, and from the listing otherwise (bytes divided by the
sampled bytes per record). A URL table's sampled images are fetched, as ingest will fetch them
(the source's download settings; a failure is a `download_error` reject). Captions kept in a
joined table are not joined here: such a source's samples count as captioned. The arithmetic that turns
both into rows, streams, bytes and hours is `prx_core.stages.plan.estimates`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prx_core.compute.parallel import imap_tasks, on_cluster
from prx_core.image.buckets import Drop, assign_bucket
from prx_core.image.decode import DEFAULT_MAX_PIXELS, Rejection
from prx_core.image.imaging import process_image
from prx_core.models.caption_text import clean_caption
from prx_core.sources.catalog import SourceSpec
from prx_core.sources.ingest import content_id, inspect_image
from prx_core.sources.readers import fragment_sizes, read_fragment
from prx_core.stages.samples.refusals import EXAMPLE_CHARS, KEY_CHARS, one_line
from prx_core.store.storage import filesystem_for

SAMPLE = 1_000
FRAGMENTS = 20  # fragments read per source, at most: the sample is spread over the source
THREADS = 8


@dataclass
class Bucketed:
    """One sampled image that gets a bucket: what its MDS sample will hold."""

    bucket: str  # "<tier>/<w>x<h>", the stream
    captioned: bool  # has a source caption
    jpeg_bytes: int  # the rendered JPEG q92
    caption_bytes: int
    content: str  # SHA-256 of the source bytes


@dataclass
class SampleStats:
    """What the readers of a source's sampled fragments measured; `merge` adds two up."""

    read: int = 0
    record_bytes: int = 0  # image and caption bytes of every record read
    rejected: Counter[str] = field(default_factory=Counter)  # reason -> records (reader or decode)
    dropped: Counter[str] = field(default_factory=Counter)  # below_floor, aspect_ratio
    captions: int = 0  # records with a non-empty source caption
    caption_words: int = 0
    bucketed: list[Bucketed] = field(default_factory=list)
    inspect_s: float = 0.0  # CPU seconds in the validating decode, over `read - reader rejects`
    decoded: int = 0
    render_s: float = 0.0  # CPU seconds rendering the bucketed images
    fragments: int = 0
    read_whole: int = 0  # fragments read to their end: when every fragment was, `read` is the rows
    examples: dict[str, dict[str, str]] = field(default_factory=dict)  # reason -> its first {key, message}

    def merge(self, other: SampleStats) -> SampleStats:
        return SampleStats(self.read + other.read, self.record_bytes + other.record_bytes,
                           self.rejected + other.rejected, self.dropped + other.dropped,
                           self.captions + other.captions, self.caption_words + other.caption_words,
                           self.bucketed + other.bucketed, self.inspect_s + other.inspect_s,
                           self.decoded + other.decoded, self.render_s + other.render_s,
                           self.fragments + other.fragments, self.read_whole + other.read_whole,
                           {**other.examples, **self.examples})

    def refuse(self, reason: str, key: str, message: str, count: int = 1) -> None:
        """Counts a refused record; the first of each reason is kept as its example."""
        self.rejected[reason] += count
        self.examples.setdefault(reason, {"key": one_line(key, KEY_CHARS), "message": one_line(message, EXAMPLE_CHARS)})


@dataclass
class SourceSize:
    """The whole source as listed: files, bytes, and rows (`rows_from` says how they were had)."""

    fragments: int
    bytes: int
    rows: int | None  # None: estimated from the sample (`bytes / bytes per sampled record`)
    rows_from: str


def sample_source(spec: SourceSpec, sample: int = SAMPLE, storage_options: dict[str, Any] | None = None,
                  max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[SampleStats, SourceSize]:
    """Read and measure about `sample` records of the source, from fragments spread over it."""
    sizes = fragment_sizes(spec, storage_options)
    picked = spread(sizes, min(FRAGMENTS, max(1, sample)))
    quota = -(-sample // max(1, len(picked)))
    calls = [(spec, path, quota, storage_options, max_pixels) for path, _ in picked]
    stats = SampleStats()
    for part in _map(sample_fragment, calls):
        stats = stats.merge(part)
    total = sum(size for _, size in sizes)
    if stats.read_whole == len(sizes):  # a source smaller than the sample: every record was read
        return stats, SourceSize(len(sizes), total, stats.read, "every record read")
    return stats, SourceSize(len(sizes), total, exact_rows(spec, sizes, storage_options), _rows_from(spec, sizes))


def spread(items: list[Any], count: int) -> list[Any]:
    """`count` items evenly spaced over `items` (all of them when there are fewer)."""
    if len(items) <= count:
        return list(items)
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def sample_fragment(spec: SourceSpec, fragment: str, limit: int, storage_options: dict[str, Any] | None,
                    max_pixels: int) -> SampleStats:
    """Worker: the first `limit` records of one fragment, each validated, bucketed and rendered as
    the stages will (CPU time of this thread only: other workers do not inflate it). A fragment
    that cannot be read is one `unreadable_fragment` reject with the error, as in `samples`."""
    stats = SampleStats(fragments=1, read_whole=1)
    try:
        _measure(spec, fragment, limit, storage_options, max_pixels, stats)
    except Exception as exc:  # the reader's own error (a column, a format): what ingest would refuse
        stats.refuse("unreadable_fragment", fragment, f"{type(exc).__name__}: {exc}", max(1, limit - stats.read))
        stats.read, stats.read_whole = max(stats.read, limit), 0
    return stats


def _measure(spec: SourceSpec, fragment: str, limit: int, storage_options: dict[str, Any] | None, max_pixels: int,
             stats: SampleStats) -> None:
    joined_captions = any(j.caption_column for j in spec.joins)  # not joined here: assumed present
    for row in _records(spec, fragment, limit + 1, storage_options):
        if stats.read == limit:  # one more record: the fragment goes on past the quota
            stats.read_whole = 0
            break
        data, caption = row["image"] or b"", clean_caption(row["caption"]).text
        stats.read += 1
        stats.record_bytes += len(data) + len((row["caption"] or "").encode())
        captioned = bool(caption) or joined_captions
        if caption:
            stats.captions += 1
            stats.caption_words += len(caption.split())
        if row["reject_reason"]:
            stats.refuse(row["reject_reason"], row["source_key"] or "", row["reject_message"] or "")
            continue
        began = time.thread_time()
        facts = inspect_image(data, max_pixels)
        stats.inspect_s += time.thread_time() - began
        stats.decoded += 1
        if isinstance(facts, Rejection):
            stats.refuse(facts.reason, row["source_key"] or "", facts.message)
            continue
        bucket = assign_bucket(facts.width, facts.height)
        if isinstance(bucket, Drop):
            stats.dropped[bucket.reason] += 1
            continue
        began = time.thread_time()
        rendered = process_image(data, max_pixels, facts=False)
        stats.render_s += time.thread_time() - began
        if isinstance(rendered, Rejection):
            stats.refuse(rendered.reason, row["source_key"] or "", rendered.message)
            continue
        stats.bucketed.append(Bucketed(f"{bucket.tier}/{bucket.name}", captioned, len(rendered.jpeg),
                                       len(caption.encode()) if caption else 0, content_id(data)))


def _records(spec: SourceSpec, fragment: str, limit: int, storage_options: dict[str, Any] | None) -> Iterator[dict]:
    seen = 0
    for batch in read_fragment(spec, fragment, storage_options):
        for row in batch.select(["source_key", "image", "caption", "reject_reason", "reject_message"]).to_pylist():
            if seen >= limit:
                return
            seen += 1
            yield row


def exact_rows(spec: SourceSpec, sizes: list[tuple[str, int]], storage_options: dict[str, Any] | None) -> int | None:
    """Rows from metadata: a Lance dataset's count, parquet files' footers; None for other formats."""
    if spec.format == "lance":
        import lance

        from prx_core.sources.tables import lance_options

        return lance.dataset(spec.uri, storage_options=lance_options(spec.uri, storage_options)).count_rows()
    if not _has_footers(spec, sizes):
        return None
    import pyarrow.parquet as pq

    fs = filesystem_for(spec.uri, storage_options)

    def rows_of(path: str) -> int:
        with fs.open(path, "rb") as handle:
            return pq.ParquetFile(handle).metadata.num_rows

    with ThreadPoolExecutor(THREADS) as pool:  # one footer read per file
        return sum(pool.map(rows_of, [p for p, _ in sizes]))


def _has_footers(spec: SourceSpec, sizes: list[tuple[str, int]]) -> bool:
    """Whether every data file is parquet, whose footer holds its row count."""
    return spec.format in ("parquet", "huggingface") and all(p.lower().endswith(".parquet") for p, _ in sizes)


def _rows_from(spec: SourceSpec, sizes: list[tuple[str, int]]) -> str:
    if spec.format == "lance":
        return "lance metadata"
    return "parquet footers" if _has_footers(spec, sizes) else "listed bytes / sampled bytes per record"


def _map(fn: Any, calls: list[tuple[Any, ...]]) -> Iterator[Any]:
    """Ray tasks on a cluster (the images decode on workers), threads in this process otherwise."""
    if on_cluster():
        yield from (result for _, result in imap_tasks(fn, calls))
        return
    with ThreadPoolExecutor(max(1, min(THREADS, len(calls)))) as pool:
        yield from pool.map(lambda args: fn(*args), calls)
