"""The ingest unit of `samples`: one Ray task reads a group of source fragments (or a range of
one), validates every image (prx_core.sources.ingest) and writes the accepted rows straight into
uncommitted Lance fragments of up to a million rows, its refusals into `rejects` fragments; a unit
that keeps failing becomes, on the driver, one `unreadable_fragment` reject per source file
(prx_core.stages.samples.losses)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.faults import pause_point
from prx_core.compute.units import UNIT_BEGAN, Unit, UnitRun
from prx_core.sources.ingest import ingest_batch
from prx_core.sources.joins import Joiner
from prx_core.sources.readers import read_fragment
from prx_core.sources.row_ranges import range_label
from prx_core.sources.tables import ReadGuard
from prx_core.stages.opt_out.takedowns import taken_down_keys
from prx_core.stages.samples.losses import UNREADABLE_FRAGMENT, lost_unit, unreadable_fragment
from prx_core.stages.samples.refusals import examples_by_reason
from prx_core.stages.samples.settings import SamplesSettings
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import unit_outputs, write_rejects

FRAGMENT_ROWS = 1_000_000  # Lance rows per data file: what queries and compaction want
FETCH_SHARE = 0.8  # of a unit's time limit spent fetching URLs at most; the rest decodes, writes and records


def ingest_unit(unit: Unit, run: UnitRun, unit_seconds: float | None = None) -> dict[str, Any]:
    """Ray task: read a group of source fragments, write its samples and rejects as Lance fragments
    (no commit). A corrupt file becomes one reject row for what could not be read. URLs stop being
    fetched `FETCH_SHARE` into the unit's time limit (`not_fetched` rejects), so a unit of slow
    hosts commits what it fetched instead of being cancelled whole; taken-down keys are refused
    (`taken_down`), a URL's before it is fetched."""
    storage, params = run.storage, run.manifest.params
    settings = SamplesSettings.from_params(params)
    spec = settings.spec
    began = UNIT_BEGAN.get() or time.time()
    guard = ReadGuard(None if unit_seconds is None else began + unit_seconds * FETCH_SHARE,
                      taken_down_keys(storage, spec.name))
    # the staged joins are not a setting: `pin_source` pins them
    joiner = Joiner(spec, params.get("joins", ()), storage.lance_storage_options())  # every reader's records
    rejects: list[pa.Table] = []
    counts: Counter[str] = Counter()

    part = tuple(unit.spec["part"]) if unit.spec.get("part") else None  # a range of its one fragment

    def accepted() -> Iterator[pa.RecordBatch]:
        pause_point(f"samples:unit:{unit.id}")  # fault tests: a hang
        for fragment in unit.spec["fragments"]:
            read = 0
            pause_point(f"samples:fragment:{fragment.rstrip('/').rsplit('/', 1)[-1]}")  # fault tests: a hang
            try:
                for batch in read_fragment(spec, fragment, storage.storage_options, guard, part):
                    samples, refused = ingest_batch(spec.name, joiner.join(batch), settings.max_pixels,
                                                    settings.max_caption_chars, counts, guard.taken_down)
                    rejects.append(refused)
                    read += batch.num_rows
                    counts.update(rows=samples.num_rows, bytes=int(pc.sum(samples["num_bytes"]).as_py() or 0))
                    yield from samples.to_batches()
            except Exception as exc:  # keep what was read, record the rest as lost
                rejects.append(unreadable_fragment(spec.name, range_label(fragment, part), read, exc))

    uri = storage.lance_uri("samples")
    reader = pa.RecordBatchReader.from_batches(schemas.SAMPLES, accepted())
    written = lance_io.write_fragments(uri, reader, schemas.SAMPLES, storage.lance_storage_options(), FRAGMENT_ROWS)
    refused = pa.concat_tables(rejects) if rejects else schemas.REJECTS.empty_table()
    refused_fragments = write_rejects(storage, refused)
    return {
        "rows": counts["rows"], "bytes": counts["bytes"], "rejected": refused.num_rows,
        "reasons": dict(Counter(refused["reason"].to_pylist())), "source_fragments": len(unit.spec["fragments"]),
        "captions_cleaned": counts["captions_cleaned"], "captions_truncated": counts["captions_truncated"],
        "examples": examples_by_reason(refused),
        **unit_outputs(storage, "samples", written, refused_fragments),
    }


def failed_unit(unit: Unit, run: UnitRun, message: str) -> dict[str, Any]:
    """On the driver, for a unit that kept failing: its fragments as `unreadable_fragment` rejects
    (nothing of it is kept: what its attempts wrote is never committed); a unit's row range of a
    table with default keys as one such reject per row, so every row of the source is accounted for."""
    refused = lost_unit(SamplesSettings.from_params(run.manifest.params).spec, unit.spec, message)
    return {"rows": 0, "bytes": 0, "rejected": refused.num_rows, "reasons": {UNREADABLE_FRAGMENT: refused.num_rows},
            "source_fragments": len(unit.spec["fragments"]), "examples": examples_by_reason(refused),
            **unit_outputs(run.storage, "samples", [], write_rejects(run.storage, refused))}
