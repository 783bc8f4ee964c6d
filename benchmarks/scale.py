"""Scale benchmark: the CPU graph (source captions) at several sizes, and a resume after SIGKILL.

Per size, on a synthetic parquet source of distinct small photos (generated once, cached), each
stage's driver runs in a fresh process (benchmarks.scale_driver) connected to a Ray cluster this
process starts, by default a fresh one per stage so the workers' peak RSS is that stage's. Per
stage: rows/s, driver peak RSS, the largest worker's peak RSS, Lance versions and fragments made.
Unit sizes are a constant number of rows at every size, so rows/s compares like with like.
`process_image` is timed on one core over the same photos (a pass before each graph stage and three
after: the median), and the graph's images/s is compared with it times the cores. Then, per
work-unit stage, a resume trial: the driver is SIGKILLed half way through the stage
(PRX_PAUSE_AT), the units it had started but not recorded are counted as the work lost, and the
rerun must skip exactly the recorded ones.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.settle import settled_counts
from benchmarks.scale_driver import (
    GRAPH,
    REPO,
    RESUMABLE,
    STAGES,
    UNIT_PREFIX,
    Cluster,
    driver_command,
    driver_env,
    run_driver,
    stage_entry,
    table_state,
)
from prx_core.compute.actors import UNITS_PER_ACTOR

GENERATOR = 1  # bump when the photos change: the cache is keyed by it
SHAPES = ((640, 480), (480, 640))  # two streams (buckets) per size
# `tiny` photos: the smallest that still bucket (the 384x384 floor), with the detail of a 14x10
# thumbnail and JPEG q60-75 so that they and their renders are small (~7 KB + ~20 KB): a 1M-row
# run (source, its copy in `samples`, compaction's copy, the MDS) then fits ~50 GB of disk.
# Decoding and rendering still cost what their pixels cost.
TINY_SHAPES = ((448, 336), (336, 448))
TINY_DETAIL = 32  # rendered at 1/32 of the size, then upscaled
SCHEMA = pa.schema([("key", pa.string()), ("image", pa.binary()), ("caption", pa.string())])


@functools.cache
def _base_photos() -> list[tuple[str, Any]]:
    from prx_core.demo.photos import load_skimage_photos

    return [(p.caption, p.image.convert("RGB")) for p in load_skimage_photos()]


def synth_photo(index: int, tiny: bool = False) -> tuple[bytes, str]:
    """Photo `index`: a rotated, zoomed, maybe mirrored, colour-shifted window of a real photo, so
    its bytes and (nearly always) its pHash differ from every other; deterministic in `index`."""
    import io

    from PIL import Image, ImageOps

    rng = np.random.default_rng([GENERATOR + tiny, index])
    bases = _base_photos()
    caption, photo = bases[index % len(bases)]
    shapes, detail = (TINY_SHAPES, TINY_DETAIL) if tiny else (SHAPES, 2)
    w, h = shapes[int(rng.integers(len(shapes)))]
    angle = math.radians(rng.uniform(-12, 12))
    cos, sin = abs(math.cos(angle)), abs(math.sin(angle))
    fit = min(photo.width / (w * cos + h * sin), photo.height / (w * sin + h * cos))  # rotated window fits
    scale = fit * rng.uniform(0.35, 0.95)  # source pixels per output pixel
    bw, bh = scale * (w * cos + h * sin), scale * (w * sin + h * cos)
    cx, cy = rng.uniform(bw / 2, photo.width - bw / 2), rng.uniform(bh / 2, photo.height - bh / 2)
    # output pixel -> source point, at 1/detail size then resized: a full-size bilinear affine is 4x slower
    a, b = detail * scale * math.cos(angle), -detail * scale * math.sin(angle)
    half_w, half_h = w / (2 * detail), h / (2 * detail)
    coeffs = (a, b, cx - a * half_w - b * half_h, -b, a, cy + b * half_w - a * half_h)
    image = photo.transform((w // detail, h // detail), Image.Transform.AFFINE, coeffs, Image.Resampling.BILINEAR)
    image = image.resize((w, h), Image.Resampling.BICUBIC if tiny else Image.Resampling.BILINEAR)
    mirrored = bool(rng.random() < 0.5)
    if mirrored:
        image = ImageOps.mirror(image)
    gains = rng.uniform(0.8, 1.2, 3)
    image = image.point([min(255, int(v * g)) for g in gains for v in range(256)])
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=int(rng.integers(60, 76) if tiny else rng.integers(80, 93)))
    tone = "warm" if gains[0] > gains[2] else "cool"
    text = (f"{caption}, in {tone} light, {'mirrored, ' if mirrored else ''}turned {math.degrees(angle):+.0f} "
            f"degrees, {1 / scale:.1f}x zoom")
    return buffer.getvalue(), text


def _write_part(path: str, start: int, count: int, tiny: bool = False) -> None:
    rows = [synth_photo(i, tiny) for i in range(start, start + count)]
    table = pa.table({"key": [f"img{i:08d}" for i in range(start, start + count)], "image": [r[0] for r in rows],
                      "caption": [r[1] for r in rows]}, schema=SCHEMA)
    pq.write_table(table, path + ".tmp", row_group_size=128)
    os.replace(path + ".tmp", path)  # a killed generator never leaves a truncated file in the cache


def synthetic_source(cache: Path, rows: int, file_rows: int, workers: int, tiny: bool = False) -> Path:
    """A folder of parquet files holding photos 0..rows-1, `file_rows` a file. Files are generated
    once into a pool shared by all sizes (a size's files are the first of the pool) and hard-linked."""
    kind = f"g{GENERATOR}{'-tiny' if tiny else ''}-f{file_rows}"
    pool = cache / f"photos-{kind}"
    source = cache / "sources" / f"{kind}-n{rows}"
    pool.mkdir(parents=True, exist_ok=True)
    source.parent.mkdir(exist_ok=True)
    parts = [(pool / f"part-{j:05d}-{min(file_rows, rows - start)}.parquet", start, min(file_rows, rows - start))
             for j, start in enumerate(range(0, rows, file_rows))]
    missing = [p for p in parts if not p[0].exists()]
    if missing:
        print(f"generating {sum(p[2] for p in missing)} synthetic photos into {pool} ...", flush=True)
        import multiprocessing

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as executor:
            list(executor.map(_write_part, *zip(*((str(p), s, c, tiny) for p, s, c in missing))))
    if not source.is_dir():
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=".staging-"))
        for path, _, _ in parts:
            os.link(path, staging / path.name)
        staging.rename(source)
    return source


def unit_sizes(unit_rows: int, source: Path) -> dict[str, int]:
    """Rows per unit of every stage, the same at every size: source files of half a unit, two
    files per `samples` unit (a byte budget of 2.5 mean files), MDS chunks of half a unit."""
    files = sorted(source.glob("*.parquet"))
    mean = sum(f.stat().st_size for f in files) / len(files)
    return {"unit_rows": unit_rows, "source_file_rows": max(1, unit_rows // 2), "samples_files_per_unit": 2,
            "samples_unit_bytes": int(2.5 * mean), "row_unit_rows": unit_rows, "route_rows": unit_rows,
            "chunk_rows": max(1, unit_rows // 2)}


def reference_photos(source: Path, count: int = 300) -> list[bytes]:
    """The first `count` photos of the source, which `process_image` is timed over."""
    images: list[bytes] = []
    for path in sorted(source.glob("*.parquet")):
        images += pq.read_table(path, columns=["image"])["image"].to_pylist()[: count - len(images)]
        if len(images) >= count:
            break
    return images


def process_image_pass(images: list[bytes]) -> float:
    """images/s of one pass of `process_image` over `images` on one core (~1 s). The benchmark
    times a pass before each stage of the graph and a few after it, and takes the median: this
    machine's speed drifts by 2x within minutes, so a reference timed once, apart from the graph,
    measured another machine (461 and 400 images/s in two runs of one day)."""
    from benchmarks.image_path import one_core
    from prx_core.image.imaging import process_image

    with one_core():
        for data in images[:10]:
            process_image(data)
        start = time.perf_counter()
        for data in images:
            process_image(data)
        return len(images) / (time.perf_counter() - start)


MODEL_STAGES = ("captions_model", "caption_labels", "caption_embeddings")  # stand-in models: busy fraction
ASSETS = {"captions_model": "captions"}  # the asset (and folder under _runs) of a benchmark stage


def resume_trial(stage: str, job: dict[str, Any], units: int, cluster: Cluster, timeout: float = 3600) -> dict[str, Any]:
    """SIGKILL the stage's driver after half its units of the phase completed, count what was
    started but not recorded (the work a rerun redoes), then rerun and check it skips the rest."""
    from prx_core.compute.faults import MARKER
    from prx_core.compute.unit_results import REPORTS
    from prx_core.stages.unchanged import LATEST
    from prx_core.image.decode import DEFAULT_MAX_PIXELS

    phase, half = RESUMABLE[stage], max(1, units // 2)
    asset = ASSETS.get(stage, stage)
    point = f"{asset}:{phase}:{half}"
    with cluster.session() as address:
        job = {**job, "stage": stage, "address": address}
        if stage == "mds_shards":  # chunks are named after content and settings: the graph's would all be reused
            job["max_pixels"] = DEFAULT_MAX_PIXELS - 1  # a setting no photo here is near: the same bytes, new names
        job["trial"] = 1  # captions_model: another stand-in version, so the trial captions again
        if stage == "samples":  # an unchanged source re-ingests nothing: forget the last commit (operations.md)
            Path(job["root"], REPORTS, "samples", job["source"]["name"], LATEST).unlink(missing_ok=True)
        proc = subprocess.Popen(driver_command(job), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                env=driver_env(PRX_PAUSE_AT=point), start_new_session=True)
        deadline, paused = time.monotonic() + timeout, False
        for line in proc.stderr:
            if line.startswith(f"{MARKER} {point}") or time.monotonic() > deadline:
                paused = line.startswith(MARKER)
                break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        attempts = list(Path(job["root"], "_runs", asset, job["source"]["name"]).glob("*/run.json"))
        attempt = attempts[0].parent if len(attempts) == 1 else Path("/nonexistent")
        counts = settled_counts(attempt, UNIT_PREFIX[phase])
        rerun = run_driver(job)
        workers = int(cluster.cpus)
    again = rerun["units"].get(phase, {})
    redone = counts[0] - counts[1]
    return {"phase": phase, "units": units, "killed_after": half, "paused": paused, "started": counts[0],
            "recorded": counts[1], "redone": redone, "redone_fraction": redone / max(units, 1), "workers": workers,
            "rerun_skipped": again.get("skipped"), "rerun_ran": again.get("ran"), "rerun_reused": again.get("reused"),
            "rerun_seconds": rerun["seconds"],
            "consistent": paused and again.get("skipped") == counts[1] and again.get("ran") == units - counts[1]}


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prx-bench-scale"


def run_size(rows: int, job: dict[str, Any], cluster: Cluster, names: tuple[str, ...],
             reference: int = 300) -> dict[str, Any]:
    """The stages once each, in graph order, on an empty corpus root; a failed stage is reported,
    not fatal. The graph's images/s is over the stages of GRAPH that ran (`graph_stages`);
    `process_image` is timed over the first `reference` photos."""
    stages: dict[str, dict[str, Any]] = {}
    photos, passes = reference_photos(Path(job["source"]["uri"]), reference), []
    for stage in names:
        if stage in GRAPH:
            passes.append(process_image_pass(photos))
        with cluster.session() as address:
            before = table_state(job["root"])
            try:
                result = run_driver({**job, "stage": stage, "address": address})
            except RuntimeError as exc:
                stages[stage] = {"error": str(exc)[-2000:]}
                print(f"  {stage:<15} FAILED: {str(exc)[-300:]}", flush=True)
                continue
            stages[stage] = entry = stage_entry(result, before, table_state(job["root"]))
        print(f"  {stage:<15} {entry['rows']:>7} rows {entry['seconds']:7.1f} s {entry['rows_per_s']:8.0f} rows/s  "
              f"driver {entry['driver_peak_rss_mb']:5.0f} MB  worker {entry['worker_peak_rss_mb']:5.0f} MB", flush=True)
    graph = [stages[s] for s in GRAPH if s in stages]
    failed = any("error" in s for s in graph)
    seconds = None if failed else sum(s["seconds"] for s in graph)
    passes += [process_image_pass(photos) for _ in range(3)]
    rate = statistics.median(passes)
    return {"rows": rows, "stages": stages, "units": job["units"], "graph_stages": [s for s in GRAPH if s in stages],
            "graph_seconds": seconds, "graph_images_per_s": rows / seconds if seconds else None,
            "graph_wall_seconds": None if failed else sum(s["wall_s"] for s in graph),  # with process start-ups
            "process_image_images_per_s": rate, "process_image_passes": [round(r, 1) for r in passes],
            "cores": cluster.cpus,
            "process_image_images_per_s_x_cores": rate * cluster.cpus}


def _spread(passes: list[float] | None) -> str:
    return f"{len(passes)} passes, {min(passes):.0f}-{max(passes):.0f}" if passes else "one pass"


def select(stages: tuple[str, ...] | None, resume: tuple[str, ...] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The stages to run, in graph order, and those given a resume trial (default: every work-unit
    stage that runs); ValueError names what cannot be."""
    unknown = sorted(set(stages or ()) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage {', '.join(unknown)} (stages: {', '.join(STAGES)})")
    stages = tuple(s for s in STAGES if s in (stages or STAGES))
    resume = tuple(s for s in RESUMABLE if s in stages) if resume is None else resume
    if unknown := sorted(set(resume) - set(RESUMABLE).intersection(stages)):
        raise ValueError(f"no resume trial for {', '.join(unknown)}: only for work-unit stages that run "
                         f"({', '.join(s for s in RESUMABLE if s in stages)})")
    return stages, tuple(s for s in RESUMABLE if s in resume)


def run(sizes: tuple[int, ...] = (10_000, 100_000), unit_rows: int = 5_000, cpus: int | None = None,
        cache: str | None = None, workdir: str | None = None, resume_rows: int | None = None,
        resume: tuple[str, ...] | None = None, fresh_ray: bool = True,
        stages: tuple[str, ...] | None = None, model_ms: float = 2.0, tiny: bool = False,
        reference: int = 300) -> dict[str, Any]:
    """The whole benchmark. The resume trials run at `resume_rows` (default: the largest size)
    after its graph. Corpora are built in `workdir` and kept, or in a temporary folder deleted
    size by size. `stages` (default all) run in graph order; each needs the earlier ones it reads.
    The stand-in models cost `model_ms` per image or caption; `tiny` photos fit a 1M-row run on disk.
    Each `process_image` pass times `reference` photos (~1 s for 300; fewer for a quick run)."""
    from benchmarks.image_path import _cpu_name

    stages, resume = select(stages, resume)
    cpus = cpus or os.cpu_count() or 1
    sizes = tuple(sorted(sizes))
    resume_rows = resume_rows or sizes[-1]
    work = Path(workdir or tempfile.mkdtemp(prefix="prx-bench-scale-"))
    cluster = Cluster(cpus, fresh_ray)
    results: dict[str, Any] = {"cpus": cpus, "cpu": _cpu_name(), "python": sys.version.split()[0], "unit_rows": unit_rows,
                               "model_ms": model_ms, "tiny_photos": tiny, "reference_photos": reference,
                               "fresh_ray_per_stage": fresh_ray, "resume_rows": resume_rows, "sizes": [], "resume": {}}
    try:
        for rows in sizes:
            source = synthetic_source(Path(cache) if cache else default_cache(), rows, max(1, unit_rows // 2), cpus, tiny)
            spec = {"name": "bench", "format": "parquet", "uri": str(source), "image_column": "image",
                    "caption_column": "caption", "key_column": "key"}
            job = {"root": str(work / f"corpus-{rows}"), "source": spec, "units": unit_sizes(unit_rows, source),
                   "cpus": cpus, "model_seconds": model_ms / 1000}
            print(f"{rows} rows, {cpus} cores: {', '.join(stages)}", flush=True)
            size = run_size(rows, job, cluster, stages, reference)
            results["sizes"].append(size)
            for stage in resume if rows == resume_rows else ():
                done = size["stages"][stage]
                if "error" in done:
                    continue
                try:
                    trial = resume_trial(stage, job, done["units"][RESUMABLE[stage]]["units"], cluster)
                except RuntimeError as exc:  # the rerun failed
                    results["resume"][stage] = {"error": str(exc)[-2000:]}
                    continue
                results["resume"][stage] = trial
                print(f"  resume {stage}: {trial['redone']} of {trial['units']} units redone "
                      f"(rerun skipped {trial['rerun_skipped']}, ran {trial['rerun_ran']})", flush=True)
            if workdir is None:
                shutil.rmtree(job["root"], ignore_errors=True)  # 100,000 rows are ~5 GB
    finally:
        cluster.close()
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["targets"] = targets(results)
    return results


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, measured (reported, never asserted): pass is None when not measurable."""
    out: list[dict[str, Any]] = []

    def add(name: str, stage: str | None, value: float | None, limit: float, higher: bool) -> None:
        ok = None if value is None else (value >= limit if higher else value <= limit)
        out.append({"target": name, "stage": stage, "value": value, "op": ">=" if higher else "<=", "limit": limit,
                    "pass": ok})

    sizes = results["sizes"]
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        for stage in small["stages"]:
            a, b = small["stages"].get(stage, {}), large["stages"].get(stage, {})
            usable = "error" not in a and "error" not in b and a and b
            add(f"driver peak RSS at {large['rows']} rows / at {small['rows']} rows", stage,
                b["driver_peak_rss_mb"] / a["driver_peak_rss_mb"] if usable else None, 1.2, higher=False)
            add(f"rows/s at {large['rows']} rows / at {small['rows']} rows", stage,
                b["rows_per_s"] / a["rows_per_s"] if usable else None, 0.9, higher=True)
    for size in sizes:
        graph = size["graph_images_per_s"]
        add(f"graph images/s / (process_image images/s x {size['cores']} cores) at {size['rows']} rows", None,
            graph / size["process_image_images_per_s_x_cores"] if graph else None, 0.7, higher=True)  # issue 24
    if sizes:
        large = sizes[-1]
        for stage in MODEL_STAGES:
            entry = large["stages"].get(stage, {})
            busy = entry.get("extra", {}).get("model_busy_fraction") if "error" not in entry else None
            if entry:
                add(f"model busy fraction of the stage's wall time at {large['rows']} rows", stage, busy, 0.9, higher=True)
        for stage in ("captions", "captions_model"):
            entry = large["stages"].get(stage, {})
            if entry:
                versions = entry.get("tables", {}).get("captions", {}).get("versions") if "error" not in entry else None
                add(f"captions Lance versions made at {large['rows']} rows", stage, versions, 36, higher=False)
    for stage, trial in results["resume"].items():  # a model actor has two units: one on the model, one preparing
        add("units redone after a SIGKILL half way / workers (rerun consistent)", stage,
            trial["redone"] / trial["workers"] if trial.get("consistent") else None,
            float(UNITS_PER_ACTOR) if stage in MODEL_STAGES else 1.0, higher=False)
    return out


def failed_row(stage: str, entry: dict[str, Any]) -> str:
    """A table row for a stage or trial that failed: the last line of its error."""
    return f"| {stage} | failed: {entry['error'].strip().splitlines()[-1][:120]} |"


def format_table(results: dict[str, Any]) -> str:
    lines = []
    for size in results["sizes"]:
        units = size["units"]
        lines += [f"\n{size['rows']} rows, {size['cores']} cores; units of {units['unit_rows']} rows (source files of "
                  f"{units['source_file_rows']}, {units['samples_files_per_unit']} per samples unit, MDS chunks of "
                  f"{units['chunk_rows']})", "",
                  "| stage | rows | s | rows/s | driver MB | worker MB | versions | fragments | units | load |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for stage, e in size["stages"].items():
            if "error" in e:
                lines.append(failed_row(stage, e))
                continue
            counts = ", ".join(f"{phase} {u['units']}" if phase != "units" else str(u["units"]) for phase, u in e["units"].items())
            lines.append(f"| {stage} | {e['rows']} | {e['seconds']:.1f} | {e['rows_per_s']:.0f} | {e['driver_peak_rss_mb']:.0f} | "
                         f"{e['worker_peak_rss_mb']:.0f} | {e['lance_versions']} | {e['lance_fragments']:+d} | {counts or '-'} | "
                         f"{e['load_avg_1m']:.1f} |")
        mds = size["stages"].get("mds_shards", {}).get("extra", {})
        if mds.get("verify_bytes_published"):
            lines.append(f"\nmds_shards read-back (in its seconds): {mds['verify_bytes_read'] / 1e6:.1f} MB of "
                         f"{mds['verify_bytes_published'] / 1e6:.1f} MB published "
                         f"({mds['verify_bytes_read'] / mds['verify_bytes_published']:.1%}) in {mds['verify_seconds']:.1f} s, "
                         f"{mds['verify_problems']} problems")
        graph = size["graph_images_per_s"]
        lines.append(f"\ngraph ({', '.join(size['graph_stages'])}): " + (f"{graph:.1f} images/s" if graph else "incomplete")
                     + f"; process_image {size['process_image_images_per_s']:.1f} images/s on one core (median of "
                     f"{_spread(size.get('process_image_passes'))}) x {size['cores']} = {size['process_image_images_per_s_x_cores']:.1f}")
    if results["resume"]:
        lines += [f"\nresume after a SIGKILL half way ({results['resume_rows']} rows)", "",
                  "| stage | phase | units | killed after | recorded | redone | workers | rerun skipped / ran | consistent |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for stage, t in results["resume"].items():
            if "error" in t:
                lines.append(failed_row(stage, t))
                continue
            lines.append(f"| {stage} | {t['phase']} | {t['units']} | {t['killed_after']} | {t['recorded']} | {t['redone']} | "
                         f"{t['workers']} | {t['rerun_skipped']} / {t['rerun_ran']} | {t['consistent']} |")
    lines.append("\ntargets (reported, not asserted)")
    for t in results["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"{verdict} {t['target']}{': ' + t['stage'] if t['stage'] else ''} = {value} ({t['op']} {t['limit']})")
    return "\n".join(lines)
