"""Stage `buckets`: tier and (width, height) of every sample, a pure function of its size.

No pixels are read: the upright size recorded at ingest decides. Dropped samples (below the
384² floor, aspect ratio outside [0.5, 2]) also go to `rejects` so every loss has a reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.image.buckets import TIERS, Drop, assign_bucket
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import reject_row, rejects_predicate, source_predicate, write_partition
from prx_core.store.storage import Storage


@dataclass
class BucketsReport:
    source: str
    rows: int
    bucketed: int
    dropped: dict[str, int]
    histogram: dict[str, int] = field(default_factory=dict)  # "<tier>/<w>x<h>" -> count
    samples_version: int = 0
    buckets_version: int = 0


def bucket_samples(samples: pa.Table, max_tier: int = TIERS[-1]) -> tuple[pa.Table, pa.Table]:
    """BUCKETS rows for `samples` (sample_id, source, source_key, content_id, width, height), and
    the REJECTS rows of the dropped ones."""
    buckets: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    for row in samples.sort_by("sample_id").to_pylist():
        width, height = row["width"], row["height"]
        assigned = assign_bucket(width, height, max_tier=max_tier)
        base = {"sample_id": row["sample_id"], "source": row["source"], "content_id": row["content_id"],
                "width": width, "height": height}
        if isinstance(assigned, Drop):
            buckets.append({**base, "drop_reason": assigned.reason})
            rejects.append(reject_row(row["sample_id"], row["source"], row["source_key"], row["content_id"],
                                      "buckets", assigned.reason, assigned.message, width, height))
        else:
            buckets.append({**base, "tier": assigned.tier, "bucket_width": assigned.width,
                            "bucket_height": assigned.height, "bucket": assigned.name})
    return (pa.Table.from_pylist(buckets, schema=schemas.BUCKETS), pa.Table.from_pylist(rejects, schema=schemas.REJECTS))


def build_buckets(source: str, storage: Storage, max_tier: int = TIERS[-1]) -> BucketsReport:
    options = storage.lance_storage_options()
    samples = lance_io.open_table(storage.lance_uri("samples"), options)
    if samples is None:
        raise RuntimeError("the samples table does not exist yet: materialize `samples` first")
    columns = ["sample_id", "source", "source_key", "content_id", "width", "height"]
    table = samples.to_table(columns=columns, filter=source_predicate(source))
    buckets, rejects = bucket_samples(table, max_tier)
    version = write_partition(storage, "buckets", source_predicate(source), buckets)
    write_partition(storage, "rejects", rejects_predicate(source, "buckets"), rejects)
    kept = buckets.filter(pc.is_valid(buckets["tier"]))
    histogram = Counter(f"{t}/{b}" for t, b in zip(kept["tier"].to_pylist(), kept["bucket"].to_pylist()))
    return BucketsReport(
        source=source, rows=buckets.num_rows, bucketed=kept.num_rows,
        dropped=dict(Counter(rejects["reason"].to_pylist())), histogram=dict(sorted(histogram.items())),
        samples_version=samples.version, buckets_version=version,
    )
