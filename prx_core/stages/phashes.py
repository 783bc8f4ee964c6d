"""Stage `phashes`: the fingerprint of every sample of a source (its 64-bit DCT pHash, the match
keys that find its copies and the signature that confirms them: prx_core.image.fingerprint).

The hash is taken from a DCT-scaled decode (>= 128 px, what the 32x32 Lanczos reduction with
reducing_gap 4 uses anyway), so a 12 MP photo costs a 1/8-scale decode, and an original and
its half-size copy reach the hash from nearly the same pixels. Ingest computes it from the
decode it makes anyway to validate the image (`prx_core.sources.ingest`); this stage copies it
into the per-source table `duplicates` reads, and decodes only rows ingested before ingest took
fingerprints (no signature: a corpus built by an older version pays one small decode). Row-range
units of the pinned `samples` version run on Ray workers, which write the `phashes` and
`rejects` fragments; the driver replaces the partition of each table in one commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle, chunk, take_rows
from prx_core.compute.row_units import plan_row_units, scan_row_unit
from prx_core.compute.units import Unit, UnitResults, UnitRun
from prx_core.image.decode import DEFAULT_MAX_PIXELS, Rejection
from prx_core.stages.report import StageReport
from prx_core.sources.ingest import fingerprint_columns, inspect_image
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import commit_unit_outputs, reject_row, source_predicate, unit_outputs, write_rejects
from prx_core.store.storage import Storage
from prx_core.upkeep.indexing import index_table

TAKE_ROWS = 64  # images read at once for rows ingested without a hash: bounded worker memory
UNIT_ROWS = 1_000_000  # ingest's hashes are copied, no pixel is decoded: a million rows take seconds
COLUMNS = ["sample_id", "source", "source_key", "content_id", "width", "height", "phash", "jpeg_quality", "num_bytes",
           "match_keys", "signature", "lossless"]


@dataclass
class PhashesReport(StageReport):
    READ = {"samples": "samples_version"}
    WRITTEN = {"phashes": "phashes_version"}

    source: str
    rows: int
    failed: int
    seconds: float
    samples_version: int
    phashes_version: int
    units: UnitResults | None = None

    @property
    def images_per_second(self) -> float:
        return (self.rows + self.failed) / max(self.seconds, 1e-9)


def phash_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: the fingerprints of one row range of the pinned samples version, as ingest took
    them; a row without one (ingested before ingest took fingerprints) is decoded here, and a
    sample that cannot be decoded becomes a reject row. Writes `phashes` and `rejects` fragments."""
    storage, source = run.storage, run.manifest.partition
    options, settings = storage.lance_storage_options(), PhashesSettings.from_params(run.manifest.params)
    samples_uri, version = storage.lance_uri("samples"), run.manifest.inputs["samples"]
    hashes: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    present = set(lance_io.require_table(samples_uri, options).checkout_version(version).schema.names)
    columns = [c for c in COLUMNS if c in present]  # a `samples` table older than fingerprints lacks them
    for batch in scan_row_unit(samples_uri, version, unit.spec, columns, source_predicate(source), options,
                               batch_size=1 << 14, with_row_address=True):
        rows = batch.to_pylist()
        unhashed = [row["_rowaddr"] for row in rows if row.get("signature") is None]
        images = (image for part in chunk(unhashed, TAKE_ROWS)  # a take per 64 images, not per row or per batch
                  for image in take_rows(samples_uri, version, part, ["image"], options)["image"].to_pylist())
        for row in rows:
            if row.get("signature") is None:
                facts = inspect_image(next(images), settings.max_pixels)
                if isinstance(facts, Rejection):
                    rejects.append(reject_row(row["sample_id"], row["source"], row["source_key"], row["content_id"],
                                              "phashes", facts.reason, facts.message))
                    continue
                row.update(fingerprint_columns(facts), width=facts.width, height=facts.height)
            hashes.append({"sample_id": row["sample_id"], "source": row["source"], "phash": row["phash"],
                           "width": row["width"], "height": row["height"], "pixels": row["width"] * row["height"],
                           **{c: row[c] for c in ("jpeg_quality", "num_bytes", "match_keys", "signature", "lossless")}})
    uri = storage.lance_uri("phashes")
    written = lance_io.write_fragments(uri, pa.Table.from_pylist(hashes, schema=schemas.PHASHES), schemas.PHASHES,
                                       options) if hashes else []
    refused = write_rejects(storage, pa.Table.from_pylist(rejects, schema=schemas.REJECTS))
    return {"rows": len(hashes), "failed": len(rejects), **unit_outputs(storage, "phashes", written, refused)}


def pin_samples(run: StageRun[PhashesSettings]) -> dict[str, int | str | None]:
    """The `samples` version the units read, planned into row ranges of the partition, and the
    partition's fragments (`source_part`): other sources' ingest moves the version (volatile), and a
    rerun resumes across it while the source's own rows are the same fragments."""
    version, run.state["units"] = plan_row_units(run.storage.lance_uri("samples"), source_predicate(run.partition),
                                                 run.settings.unit_rows, run.storage.lance_storage_options())
    lance_io.upgrade_table(run.storage.lance_uri("phashes"), schemas.PHASHES, run.storage.lance_storage_options())
    return {"samples": version, "source_part": lance_io.partition_signature(  # `samples` is volatile: this pins
        run.storage.lance_uri("samples"), source_predicate(run.partition), run.storage.lance_storage_options(), version)}


def phash_units(run: StageRun[PhashesSettings]) -> None:
    run.units("units", run.state["units"], phash_unit)


def commit_phashes(run: StageRun[PhashesSettings]) -> dict[str, int]:
    version, _ = commit_unit_outputs(run.storage, "phashes", run.partition, "phashes", run.results["units"].summaries,
                                     index=index_table)
    return {"phashes": version}


def report_phashes(run: StageRun[PhashesSettings]) -> PhashesReport:
    results = run.results["units"]
    return PhashesReport(run.partition, results.total("rows"), results.total("failed"), run.seconds,
                         run.inputs["samples"], run.versions["phashes"], results)


@dataclass(frozen=True, kw_only=True)
class PhashesSettings(Settings):
    """The `phashes` settings: the pixel cap of a decode (rows without ingest's hash), rows per unit."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    unit_rows: int = UNIT_ROWS


PHASHES: Stage[PhashesSettings] = Stage(
    "phashes", reads=("samples",), writes=("phashes", "rejects"), after=("samples",),
    code_version="2", report_type=PhashesReport,
    settings=PhashesSettings,
    unit_sizes=(UnitSize("unit_rows", "Rows per `phashes` unit (ingest's hashes are copied; rows without one "
                                      "are decoded)."),),
    pin=pin_samples, work=phash_units, commit=commit_phashes, report=report_phashes,
    volatile=("samples",),  # moved by other sources' ingest: `source_part` pins this source's rows
    reusable=lambda report: True,  # a rerun over the same rows of the source runs nothing
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(PhashesReport)


def build_phashes(source: str, storage: Storage, progress: Throttle | None = None, **settings: Any) -> PhashesReport:
    """`phashes` of one source (`run_partition` of PHASHES): settings max_pixels, unit_rows."""
    return run_partition(PHASHES, storage, source, progress=progress, **settings)
