"""`prx-corpus build` in a terminal (a pseudo-terminal here) shows live progress, and saves a
report under the root that the CLI names and every materialization links to (issue 43).

One build of a small image folder (4 photos with sidecar captions, one text file named .jpg) in
a pty: the stages' progress never prints as Dagster log lines, a stage's last report stays as a
plain line, the `==>` lines print as before. The report `<root>/_reports/builds/*.md` holds the
summary, the rejects by reason with the likely fix, the duplicate and caption rates, the runs'
timings from the instance, and the explorer's command; `samples`' materialization carries its path.
~2 min on 2 busy cores.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import dagster as dg
import pytest
from PIL import Image
from test_build import CLI, cli_env

from prx_core.demo.photos import load_skimage_photos

pytestmark = pytest.mark.slow
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def write_source(base: Path) -> Path:
    folder = base / "photos"
    folder.mkdir(parents=True)
    for i, photo in enumerate([p for p in load_skimage_photos() if p.image.mode == "RGB"][:4]):
        photo.image.resize((512, 384), Image.Resampling.BICUBIC).save(folder / f"img_{i}.jpg", quality=90)
        (folder / f"img_{i}.txt").write_text(f"a photo, number {i}, of a scene")
    (folder / "notes.jpg").write_text("not an image at all")
    catalog = base / "sources.yaml"
    catalog.write_text(f"sources:\n- {{name: photos, format: imagefolder, uri: {folder}}}\n")
    return catalog


def run_in_terminal(args: list[str], timeout: float = 900) -> tuple[int, str]:
    """The CLI with a pseudo-terminal as stdin, stdout and stderr; its whole output."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([CLI, *args], stdin=slave, stdout=slave, stderr=slave, env=cli_env(COLUMNS="160"),
                            start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the slave side closed: the process is gone
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(60), b"".join(chunks).decode(errors="replace")


def test_a_terminal_build_shows_live_progress_and_saves_a_linked_report(tmp_path: Path) -> None:
    catalog, root, home = write_source(tmp_path), tmp_path / "corpus", tmp_path / "home"
    code, output = run_in_terminal(["build", "--sources", str(catalog), "--root", str(root), "--dagster-home", str(home)])
    lines = [ANSI.sub("", line.rsplit("\r", 1)[-1]) for line in output.replace("\r\n", "\n").split("\n")]
    assert code in (0, 1), output[-5000:]  # the tiny corpus's streams may warn or fail a check: not the point here

    # live progress (the status line drawn in place is tests/assets/test_build_progress.py's: a build this small
    # finishes each stage within the first 5 s report): never as Dagster log lines; last reports kept plainly
    assert not [x for x in lines if " - INFO - " in x and re.search(r"\[photos\][^:]*: \d+/\d+ ", x)], output[-3000:]
    assert any(re.match(r"^samples\[photos\][^:]*: \d+/\d+ units", x) for x in lines), output[-3000:]
    assert "==> raw_source, samples" in output and "    ok in " in output

    (named,) = [x.removeprefix("report ") for x in lines if x.startswith("report ")]
    report = Path(named)
    assert report.parent == root / "_reports" / "builds" and report.suffix == ".md", named
    text = report.read_text()
    assert text.startswith("# PRX corpus build, ") and f"- corpus root: `{root}`" in text
    for section in ("## Problems", "## Corpus", "## Rejects by reason", "## Duplicates", "## Captions", "## Timings",
                    "## Explorer"):
        assert section in text, section
    reject = next(x for x in text.splitlines() if x.startswith("| photos | samples | not_an_image |"))
    assert "| 1 | 20.0% |" in reject and "not images" in reject, reject  # 1 of 5 rows, with the likely fix
    runs = [x for x in text.split("## Timings")[1].split("Assets")[0].splitlines() if x.startswith("| ")][1:]
    assert len(runs) >= 3 and all("SUCCESS" in r or "FAILURE" in r for r in runs[1:]), runs
    assert "| photos | source" in text.split("## Captions")[1]  # the source captioner's row
    assert f"`prx-corpus browse --root {root}`" in text

    with dg.DagsterInstance.from_config(str(home)) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("samples"))
        assert event.asset_materialization.metadata["prx/build_report"].value == named
