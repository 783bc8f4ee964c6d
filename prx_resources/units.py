"""How big the work units of the per-source stages are: the trade between resume granularity
(a crash redoes at most one unit per worker), parallelism and fragment size."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from prx_core.stages import buckets, mds_shards, phashes, samples


class UnitsResource(dg.ConfigurableResource):
    """Unit sizes per stage. They shape how work is cut, never what is written: changing one starts
    a new attempt (it is part of the run manifest) and gives the same rows and MDS bytes. A small
    corpus on few cores wants small units (parallelism); PRX scale wants the defaults."""

    samples_bytes: int = Field(default=samples.UNIT_BYTES, gt=0,
                               description="Source bytes per ingest unit; one unit writes ~one Lance fragment, "
                                           "so this sets fragment size (~1M rows at 64 KB per image).")
    buckets_rows: int = Field(default=buckets.UNIT_ROWS, gt=0, description="Rows per `buckets` unit (sizes only).")
    phashes_rows: int = Field(default=phashes.UNIT_ROWS, gt=0,
                              description="Rows per `phashes` unit (ingest's hashes are copied; rows without one "
                                          "are decoded).")
    mds_route_rows: int = Field(default=mds_shards.ROUTE_ROWS, gt=0,
                                description="Rows per `mds_shards` routing unit (sizes and ids, no pixels).")
    mds_chunk_rows: int = Field(default=mds_shards.CHUNK_ROWS, gt=0,
                                description="Target rows per MDS chunk: one worker task and one sub-folder of a stream.")
    samples_seconds: float = Field(default=samples.UNIT_SECONDS, gt=0,
                                   description="Time limit of one ingest unit, retries included: a unit still running "
                                               "(a hang, a worker killed out of memory again and again) is cancelled "
                                               "and its source files become unreadable_fragment rejects.")
