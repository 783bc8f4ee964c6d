"""One stage of the scale benchmark, run and measured: `python -m benchmarks.scale_driver JOB`.

The benchmark (benchmarks.scale) starts a Ray cluster (`Cluster`) and runs each stage's driver in
a process of its own connected to it (`run_driver`), so the driver's peak RSS is the stage's own
(not Ray's start-up, not the workers') and a resume trial can SIGKILL it at a pause point
(PRX_PAUSE_AT). JOB is a JSON object: stage, root, address (the cluster's GCS), source (a
SourceSpec as a dict), units (the unit sizes); the driver prints `PRX-BENCH-RESULT {json}`.
Meanwhile this side reads the peak RSS (VmHWM) of the cluster's workers from /proc
(`WorkerPeak`) and the Lance versions and fragments before and after (`table_state`).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

RESULT = "PRX-BENCH-RESULT"
STAGES = ("samples", "buckets", "phashes", "captions", "captions_model", "caption_labels", "caption_embeddings",
          "duplicates", "duplicates_incremental", "mds_shards", "skip_lists", "compact_corpus")
# The CPU graph from ingest to MDS and skip-lists; labels and duplicates (inputs of skip_lists)
# and compaction are timed and reported, but are not part of it. `captions_model` captions again
# with a stand-in captioner of a fixed cost per image (another captioner version: nothing reused),
# to measure how busy the orchestration keeps a model; labels and embeddings use stand-ins too.
GRAPH = ("samples", "buckets", "phashes", "captions", "mds_shards", "skip_lists")
# Stages run as work units, and the phase a resume trial kills half way (PRX_PAUSE_AT).
RESUMABLE = {"samples": "units", "buckets": "units", "phashes": "units", "captions_model": "units",
             "mds_shards": "chunks", "skip_lists": "chunks"}
UNIT_PREFIX = {"units": "", "chunks": "chunk-"}  # the phase's unit ids under started/ and done/

REPO = str(Path(__file__).resolve().parents[1])
COPIED_FRACTION = 0.05  # duplicates_incremental: a new source of 5% of the rows, copies of existing photos

MODULES: dict[str, tuple[str, ...]] = {  # imported before the clock starts: a cost per process, not per row
    "samples": ("prx_core.stages.samples.stage",), "buckets": ("prx_core.stages.buckets",),
    "phashes": ("prx_core.stages.phashes",), "captions": ("prx_core.stages.captions.stage",),
    "captions_model": ("prx_core.stages.captions.stage",),
    "caption_labels": ("prx_core.stages.labels", "benchmarks.scale_models"),
    "caption_embeddings": ("prx_core.stages.caption_embeddings", "benchmarks.scale_models"),
    "duplicates": ("prx_core.stages.duplicates.stage",),
    "duplicates_incremental": ("prx_core.stages.duplicates.stage",),
    "mds_shards": ("prx_core.stages.mds_shards.stage",), "skip_lists": ("prx_core.stages.skip_lists.stage",),
    "compact_corpus": ("prx_core.ops.compaction", "prx_core.shards.mds.publish"),
}


def call_stage(stage: str, job: dict[str, Any]) -> tuple[int, Any, dict[str, Any]]:
    """The stage function, called as its Dagster asset calls it (default settings, the benchmark's
    unit sizes): (rows, its UnitResults or {phase: UnitResults} or None, other numbers)."""
    from prx_core.models.caption_base import CaptionerConfig
    from prx_core.models.label_base import LabelerConfig
    from prx_core.sources.catalog import SourceSpec
    from prx_core.store.storage import Storage

    spec, storage, units = SourceSpec.from_dict(job["source"]), Storage(job["root"]), job["units"]
    captioner, labeler = CaptionerConfig("source").version(), LabelerConfig().version()
    if stage == "samples":
        from prx_core.stages.samples.stage import build_samples

        r = build_samples(spec, storage, unit_bytes=units["samples_unit_bytes"])
        return (*counted(r), {"rejected": r.rejected, "files": r.fragments_read})
    if stage == "buckets":
        from prx_core.stages.buckets import build_buckets

        r = build_buckets(spec.name, storage, unit_rows=units["row_unit_rows"])
        return (*counted(r), {"bucketed": r.bucketed})
    if stage == "phashes":
        from prx_core.stages.phashes import build_phashes

        r = build_phashes(spec.name, storage, unit_rows=units["row_unit_rows"])
        return (*counted(r), {"failed": r.failed})
    if stage in ("captions", "captions_model"):
        from prx_core.stages.captions.stage import build_captions

        seconds = job["model_seconds"] * (1 + 1e-6 * job.get("trial", 0)) if stage == "captions_model" else 0.0
        r = build_captions(spec.name, storage, CaptionerConfig("source", seconds_per_image=seconds), actors=job["cpus"],
                           unit_rows=units["row_unit_rows"])
        return (*counted(r), {"captioned": r.captioned, "reused": r.reused, "failed": r.failed,
                              "commits": r.commits, "model_busy_fraction": round(r.model_busy_fraction, 4)})
    if stage in ("caption_labels", "caption_embeddings"):
        return model_stage(stage, spec.name, storage, captioner, job)
    if stage in ("duplicates", "duplicates_incremental"):
        from prx_core.stages.duplicates.stage import build_duplicates

        if stage == "duplicates_incremental":
            add_copied_source(storage, spec.name, COPIED_FRACTION)
        r = build_duplicates(storage)
        return (*counted(r), {"groups": r.groups, "duplicates": r.duplicates, "mode": r.mode,
                              "phashes_rows": r.phashes_rows, "affected_components": r.affected_components,
                              "member_rows": r.member_rows, "buckets": r.buckets})
    if stage == "mds_shards":
        from prx_core.image.decode import DEFAULT_MAX_PIXELS
        from prx_core.stages.mds_shards.stage import MDS_SHARDS
        from prx_core.stages.stage import run_partition

        began = time.monotonic()
        published = run_partition(MDS_SHARDS, storage, spec.name, captioner_version=captioner,
                                  max_pixels=job.get("max_pixels", DEFAULT_MAX_PIXELS), route_rows=units["route_rows"],
                                  chunk_rows=units["chunk_rows"])
        r, verified = published.mds, published.verified
        return (*counted(r), {"streams": len(r.streams), "rejects": r.rejects,
                              # the stage's then-step: the budgeted read-back after publishing, and the counts
                              "verify_seconds": round(time.monotonic() - began - r.seconds, 3),
                              "verify_bytes_read": verified.bytes_read,
                              "verify_bytes_published": verified.bytes_published,
                              "verify_problems": len(verified.problems)})
    if stage == "skip_lists":
        from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists

        r = build_skip_lists(spec.name, storage, captioner, labeler, SkipPolicy())
        return (*counted(r), {"skipped": r.skipped, "files": len(r.files)})
    return compact_corpus(storage)


def counted(report: Any) -> tuple[int, Any]:
    """The rows and units of any stage's report (`prx_core.stages.report`)."""
    summary = report.summary()
    return summary.rows, summary.units


def add_copied_source(storage: Any, source: str, fraction: float) -> int:
    """A new source `copied` holding the first `fraction` of `source`'s pHashes (the same photos
    ingested again): every one of its rows joins a group. Written before the clock starts."""
    import pyarrow as pa

    from prx_core.store import lance_io, schemas
    from prx_core.store.partitions import source_predicate, write_partition

    phashes = lance_io.require_table(storage.lance_uri("phashes"), storage.lance_storage_options())
    limit = max(1, int(phashes.count_rows(source_predicate(source)) * fraction))
    rows = phashes.to_table(filter=source_predicate(source), limit=limit)
    rows = rows.set_column(rows.schema.get_field_index("source"), "source", pa.array(["copied"] * rows.num_rows, pa.string()))
    ids = [f"copied/{s.split('/', 1)[1]}" for s in rows["sample_id"].to_pylist()]
    rows = rows.set_column(rows.schema.get_field_index("sample_id"), "sample_id", pa.array(ids, pa.string()))
    write_partition(storage, "phashes", source_predicate("copied"), rows.cast(schemas.PHASHES))
    return rows.num_rows


def model_stage(stage: str, source: str, storage: Any, captioner: str, job: dict[str, Any]) -> tuple[int, Any, dict[str, Any]]:
    """Labels or caption embeddings with a stand-in model of `model_seconds` per caption."""
    import ray.cloudpickle

    from benchmarks import scale_models
    from prx_core.compute.units import ModelSpec
    from prx_core.models.embeddings import EmbedderConfig
    from prx_core.models.label_base import LabelerConfig

    ray.cloudpickle.register_pickle_by_value(scale_models)  # workers need not import benchmarks/
    unit_rows, seconds, actors = job["units"]["row_unit_rows"], job["model_seconds"], job["cpus"]
    if stage == "caption_labels":
        from prx_core.stages.labels import build_labels

        config = LabelerConfig()
        model = ModelSpec(partial(scale_models.StandInLabels, config, seconds), actors=actors)
        r = build_labels(source, storage, captioner, config, unit_rows=unit_rows, model=model)
        done = r.labelled
    else:
        from prx_core.stages.caption_embeddings import build_caption_embeddings

        config = EmbedderConfig()
        model = ModelSpec(partial(scale_models.StandInEmbeddings, config, seconds), actors=actors)
        r = build_caption_embeddings(source, storage, captioner, config, unit_rows=unit_rows, model=model)
        done = r.embedded
    busy = r.model_seconds / max(r.seconds * actors, 1e-9)  # the report's sum: its units come condensed
    return (*counted(r), {"done": done, "reused": r.reused, "commits": r.commits,
                          "model_busy_fraction": round(busy, 4)})


def compact_corpus(storage: Any) -> tuple[int, None, dict[str, Any]]:
    """What the compact_corpus job does (prx_core.ops.compaction): per table compaction and index catch-up on
    a worker, then pruning."""
    from prx_core.ops.compaction import maintain_corpus
    from prx_core.store import lance_io

    done = maintain_corpus(storage)
    fragments = {t.table: [t.compaction.fragments_before, t.compaction.fragments_after] for t in done.tables}
    rows = lance_io.require_table(storage.lance_uri("samples"), storage.lance_storage_options()).count_rows()
    return rows, None, {"fragments_before_after": fragments, "chunks_pruned": len(done.streams.removed)}


def units_summary(results: Any, storage: Any) -> dict[str, Any]:
    """A phase's counts, peaks and time; and per unit that ran, the bytes it read and its seconds
    (from the report's detail: benchmarks.corpus_growth compares them across corpus sizes)."""
    from prx_core.compute.unit_results import read_detail

    detail = results.summaries or (read_detail(storage, results.detail_uri) if results.detail_uri else [])
    ran = [s for s in detail if "read_bytes" in s]
    return {"units": results.units, "ran": results.ran, "skipped": results.skipped,
            "reused": results.total("reused"),  # mds chunks whose content-named folder existed: no work
            "worker_peak_rss_mb": results.worker_peak_rss_mb(), "seconds": round(results.seconds, 3),
            "unit_read_bytes": [s["read_bytes"] for s in ran], "unit_seconds": [s["seconds"] for s in ran]}


def run_stage(job: dict[str, Any]) -> dict[str, Any]:
    """Connect to the benchmark's cluster, run the stage, report its numbers and this process's peak RSS."""
    import ray

    from prx_core.store.storage import Storage

    ray.init(address=job["address"], log_to_driver=False, logging_level="warning", configure_logging=False)
    started = time.monotonic()
    for module in MODULES[job["stage"]]:  # a fixed cost of the process, not of the rows: timed apart
        importlib.import_module(module)
    imported = time.monotonic()
    rows, results, extra = call_stage(job["stage"], job)
    seconds = time.monotonic() - imported
    phases = results if isinstance(results, dict) else {} if results is None else {"units": results}
    return {"stage": job["stage"], "rows": rows, "seconds": seconds, "import_s": imported - started,
            "units": {phase: units_summary(r, Storage(job["root"])) for phase, r in phases.items()},
            "driver_peak_rss_mb": peak_rss_mb(), "extra": extra}


def peak_rss_mb(pid: int | str = "self") -> float:
    """VmHWM: the peak RSS of the process's address space. Not ru_maxrss, which Linux carries
    across exec: a child of a 600 MB parent reports at least 600 MB."""
    for line in Path("/proc", str(pid), "status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0  # a zombie: no address space left


# --- the benchmark's side ---------------------------------------------------------------------


class Cluster:
    """The benchmark's Ray, started in this process (its workers are descendants of this process):
    a fresh one per `session()` when `fresh`, else one for the whole run."""

    def __init__(self, cpus: int, fresh: bool = True) -> None:
        self.cpus, self.fresh, self.address = cpus, fresh, None

    @contextmanager
    def session(self) -> Iterator[str]:
        import ray

        if self.address is None:
            if ray.is_initialized():  # its workers' memory and CPUs would not be the benchmark's own
                raise RuntimeError("the scale benchmark starts its own Ray: run it in a process without one")
            warnings.filterwarnings("ignore", message="lance is not fork-safe")  # Ray forks to exec its daemons
            ray.init(num_cpus=self.cpus, include_dashboard=False, log_to_driver=False, logging_level="warning",
                     configure_logging=False)
            self.address = ray.get_runtime_context().gcs_address
        try:
            yield self.address
        finally:
            if self.fresh:
                self.close()

    def close(self) -> None:
        import ray

        if self.address is not None:
            ray.shutdown()
            self.address = None


AGENTS = (b"ray::DashboardAgent", b"ray::RuntimeEnvAgent")  # per-node daemons, not workers


def _worker_peaks() -> dict[int, tuple[float, str]]:
    """(VmHWM, the peak RSS in MB; title) of every Ray worker process (title `ray::...`) that
    descends from this process."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    me, peaks = os.getpid(), {}
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor and ancestor != me:
            ancestor = parents.get(ancestor)
        try:
            title = Path("/proc", str(pid), "cmdline").read_bytes().split(b"\0")[0]
            if ancestor == me and title.startswith(b"ray::") and not title.startswith(AGENTS):
                peaks[pid] = (peak_rss_mb(pid), title.decode(errors="replace").strip())
        except OSError:
            continue
    return peaks


class WorkerPeak:
    """The largest peak RSS a Ray worker reached while the block ran, polled from /proc. A worker
    alive before counts only if its peak grew (a reused worker's old peak is not this stage's)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak_mb, self.title = interval, 0.0, ""
        self._baseline: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> WorkerPeak:
        self._baseline = {pid: peak for pid, (peak, _) in _worker_peaks().items()}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        for pid, (peak, title) in _worker_peaks().items():
            if peak > self._baseline.get(pid, 0.0) and peak > self.peak_mb:
                self.peak_mb, self.title = peak, f"{title} (pid {pid})"


def table_state(root: str) -> dict[str, tuple[int, int]]:
    """(version, fragments) of every corpus table that exists."""
    from prx_core.store import lance_io
    from prx_core.store.schemas import TABLES
    from prx_core.store.storage import Storage

    storage, state = Storage(root), {}
    for table in TABLES:
        if (ds := lance_io.open_table(storage.lance_uri(table))) is not None:
            state[table] = (ds.version, len(ds.get_fragments()))
    return state


def driver_command(job: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.scale_driver", json.dumps(job)]


def driver_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "LANCE_LOG": "error", **extra}


def run_driver(job: dict[str, Any]) -> dict[str, Any]:
    """Run one stage's driver process; its report plus wall time and the workers' sampled peak RSS."""
    began = time.monotonic()
    with WorkerPeak() as workers:
        proc = subprocess.run(driver_command(job), capture_output=True, text=True, cwd=REPO, env=driver_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not lines:
        raise RuntimeError(f"{job['stage']} driver failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT):])
    result.update(wall_s=time.monotonic() - began, worker_peak_rss_mb_sampled=workers.peak_mb,
                  worker_peak_process=workers.title)
    return result


def stage_entry(result: dict[str, Any], before: dict, after: dict) -> dict[str, Any]:
    """A stage's numbers for the report: the driver's result and the tables' versions and fragments
    before and after. The worker peak is the larger of the units' own ru_maxrss (Ray's workers are
    exec'd by the raylet, a small process) and the sampled VmHWM."""
    from_units = max((u["worker_peak_rss_mb"] for u in result["units"].values()), default=0.0)
    tables = {t: {"versions": after[t][0] - before.get(t, (0, 0))[0], "fragments": [before.get(t, (0, 0))[1], after[t][1]]}
              for t in after if after[t] != before.get(t)}
    return {
        "rows": result["rows"], "seconds": result["seconds"], "import_s": result["import_s"], "wall_s": result["wall_s"],
        "rows_per_s": result["rows"] / max(result["seconds"], 1e-9),
        "driver_peak_rss_mb": result["driver_peak_rss_mb"],
        "worker_peak_rss_mb": max(from_units, result["worker_peak_rss_mb_sampled"]),
        "worker_peak_rss_mb_units": from_units or None, "worker_peak_process": result["worker_peak_process"],
        "lance_versions": sum(t["versions"] for t in tables.values()),
        "lance_fragments": sum(t["fragments"][1] - t["fragments"][0] for t in tables.values()),
        "tables": tables, "units": result["units"], "extra": result["extra"],
        "load_avg_1m": os.getloadavg()[0],  # other work on the machine slows every rate
    }


def main(argv: list[str]) -> int:
    os.environ.setdefault("LANCE_LOG", "error")
    result = run_stage(json.loads(argv[0]))
    print(f"{RESULT} {json.dumps(result, default=str)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
