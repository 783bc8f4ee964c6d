"""`prx-corpus build` as an operator meets its first problems (issue 27, item 1).

- Preflight: a wrong `uri`, a column the files do not have, an unwritable root each stop the build
  in about a second, before Ray starts, with one line naming the source, the field and the fix,
  and exit 2; nothing is created under the root.
- Ctrl-C: a SIGINT sent to the build's process group (what a terminal does) once its first run
  has recorded some work units stops the build: that run is interrupted, no further run starts,
  the CLI prints "interrupted: rerun the same command to resume (N units recorded)" and exits
  130; the same command again resumes, saying it skipped those N units, and the table holds every
  row once.

Small sources only: a parquet source of 8 one-file units and 3 photos; the Ctrl-C test runs
`raw_source,samples` twice (~1 min on this 2-core machine when loaded), the preflight cases take
seconds together.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_build import CLI, Paused, Run, build_args, cli_env, run_cli

from prx_core.demo.photos import load_skimage_photos

pytestmark = pytest.mark.slow

FILES, ROWS_PER_FILE = 8, 2
PREFLIGHT_SECONDS = 20  # the CLI's imports included, on a loaded 2-core machine (about 1 s alone)


def write_sources(work: Path) -> Path:
    """`many`: 8 parquet files of 2 photos (one unit each with `units.samples_bytes: 1`);
    `photos`: an image folder of 3 photos with captions."""
    colour = [p for p in load_skimage_photos() if p.image.mode == "RGB"]
    many = work / "many"
    many.mkdir(parents=True)
    for f in range(FILES):
        rows = []
        for j in range(ROWS_PER_FILE):
            photo = colour[(ROWS_PER_FILE * f + j) % len(colour)]
            buffer = io.BytesIO()
            photo.image.resize((512 + 16 * j, 512), Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
            rows.append({"key": f"f{f}_{j}", "image": buffer.getvalue(), "caption": photo.caption})
        pq.write_table(pa.Table.from_pylist(rows), many / f"part-{f:02d}.parquet")
    photos = work / "photos"
    photos.mkdir()
    for i, photo in enumerate(colour[:3]):
        photo.image.resize((640, 480), Image.Resampling.BICUBIC).save(photos / f"img_{i}.jpg", quality=90)
        (photos / f"img_{i}.txt").write_text(photo.caption)
    catalog = work / "sources.yaml"
    catalog.write_text(f"sources:\n- {{name: many, format: parquet, uri: {many}, image_column: image, key_column: key, "
                       f"caption_column: caption}}\n- {{name: photos, format: imagefolder, uri: {photos}}}\n")
    return catalog


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sources(tmp_path_factory.mktemp("interrupt-sources"))


# -- preflight -------------------------------------------------------------------------------------

def start(args: list[str], work: Path, name: str) -> tuple[subprocess.Popen, float]:
    with open(work / f"{name}.out", "w") as out, open(work / f"{name}.err", "w") as err:
        return subprocess.Popen([CLI, *args], stdout=out, stderr=err, env=cli_env(), start_new_session=True), \
            time.monotonic()


def test_preflight_names_each_problem_in_one_line_before_starting_anything(sources: Path, tmp_path: Path) -> None:
    work = sources.parent
    wrong_uri = tmp_path / "wrong_uri.yaml"
    wrong_uri.write_text(sources.read_text().replace(f"uri: {work / 'photos'}", "uri: photoz"))
    wrong_column = tmp_path / "wrong_column.yaml"
    wrong_column.write_text(sources.read_text().replace("image_column: image", "image_column: jpg"))
    cases = {
        "uri": (build_args(wrong_uri, tmp_path / "c1", tmp_path / "h1"),
                rf"{re.escape(str(wrong_uri))}: source 'photos': field 'uri': {re.escape(str(tmp_path))}/photoz does "
                r"not exist; fix: point uri at the source's file or folder \(a relative path resolves against the "
                r"catalog's folder\)"),
        "column": (build_args(wrong_column, tmp_path / "c2", tmp_path / "h2"),
                   r".*: source 'many': field 'image_column': column 'jpg' is not in \S+/many/part-0\d\.parquet \(its "
                   r"columns: key, image, caption\); fix: set image_column to one of its columns"),
        "root": (build_args(sources, Path("/proc/prx-corpus/corpus"), tmp_path / "h3"),
                 r"corpus root \(--root\): not writable: /proc/prx-corpus/corpus: FileNotFoundError: .*; fix: give "
                 r"--root a folder .*`prx-corpus doctor --root URI` checks it"),
    }
    procs = {name: start(args, tmp_path, name) for name, (args, _) in cases.items()}
    for name, (proc, began) in procs.items():
        proc.wait(timeout=300)
        seconds = time.monotonic() - began
        result = Run(cases[name][0], proc.returncode, (tmp_path / f"{name}.out").read_text(),
                     (tmp_path / f"{name}.err").read_text(), seconds)
        assert result.returncode == 2, result.explain()
        errors = [line for line in result.stderr.splitlines() if line.startswith("prx-corpus: error: ")]
        assert len(errors) == 1 and re.fullmatch(cases[name][1], errors[0].removeprefix("prx-corpus: error: ")), \
            result.explain()
        assert "prx-corpus: 1 problem(s) found before starting: nothing was run" in result.stderr
        assert result.stdout == "" and "Traceback" not in result.stderr, result.explain()  # no Dagster, no Ray
        assert seconds < PREFLIGHT_SECONDS, (name, seconds)
    assert not (tmp_path / "c1").exists() and not (tmp_path / "c2").exists(), "a stopped build created its root"
    assert not (tmp_path / "h1").exists(), "a stopped build created its Dagster home"


# -- Ctrl-C and resume -----------------------------------------------------------------------------

def test_ctrl_c_stops_the_build_and_the_same_command_resumes(sources: Path, tmp_path: Path) -> None:
    config = tmp_path / "units.yaml"
    config.write_text("units: {samples_bytes: 1}\n")  # one parquet file per unit: 8 units
    root = tmp_path / "corpus"
    args = build_args(sources, root, tmp_path / "dh", "--select", "raw_source,samples", "--config", str(config))
    paused = Paused(args, "samples:units:2", tmp_path / "first")  # the driver waits after 2 recorded units
    paused.wait_for_marker()
    sent = time.monotonic()
    os.killpg(paused.proc.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
    try:
        paused.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        paused.kill()
        pytest.fail(f"the build went on after SIGINT:\n{paused.text()}")
    stopped = time.monotonic() - sent
    paused.close()
    out = paused.out_path.read_text()
    assert paused.proc.returncode == 130, paused.text()
    assert stopped < 60, f"{stopped:.0f} s from SIGINT to exit"
    assert re.search(r"^    interrupted in [0-9.]+ s \(run [0-9a-f]{8}\)$", out, re.M), paused.text()
    assert "==> raw_source, samples [photos]" not in out, "a run started after the SIGINT"
    assert "samples [many] interrupted" in out and "raw_source, samples [photos] not started: interrupted" in out
    assert "FAILED" not in out and "Traceback" not in out, paused.text()
    (last,) = re.findall(r"^interrupted: rerun the same command to resume \((\d+) units recorded\)$", out, re.M)
    recorded = int(last)
    assert 2 <= recorded <= FILES, paused.text()  # the units in flight at the SIGINT may have recorded too
    done = list((root / "_runs" / "samples" / "many").glob("*/done/*.json"))
    assert len(done) == recorded, (len(done), recorded)  # counted after the units in flight stopped
    assert not list((root / "_locks").rglob("*.lock")), "the interrupted run left its partition lock"

    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.explain()
    assert f"    resumed samples: {recorded} of {FILES} units recorded by an earlier attempt, skipped" in rerun.stdout, \
        rerun.explain()
    assert f"samples[many]: resuming, {recorded} units already done" in rerun.stderr, rerun.explain()
    ids = lance.dataset(str(root / "lance" / "samples.lance")).to_table(columns=["sample_id"])["sample_id"].to_pylist()
    assert len(ids) == len(set(ids)) == FILES * ROWS_PER_FILE + 3, "rows lost or duplicated by the resume"
    assert not list((root / "_runs").rglob("run.json")), "an attempt was left behind"
