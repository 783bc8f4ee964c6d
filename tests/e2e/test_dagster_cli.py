"""Dagster's own CLI on a fresh instance, and one Dagster home per root (issue 27, item 3).

`dagster asset materialize -m prx_assets.definitions --select samples --partition photos` (a real
`dagster` subprocess) is refused on a fresh DAGSTER_HOME, because no `sources` partition exists
yet; `prx-corpus sources sync` registers the catalog's names and the same command then
materializes the source. Where the home lives by default is checked for a local root, an S3 root
and the Makefile's demo (`make demo` and `make ui` share DEMO_ENV). 70-80 s under load (one embedded Ray).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lance
import pytest
from PIL import Image
from test_build import cli_env, run_cli

from prx_cli.homes import corpus_root, default_home
from prx_assets.settings import REPO
from prx_core.demo.photos import load_skimage_photos

DAGSTER = str(Path(sys.executable).with_name("dagster"))
NOT_A_PARTITION = "must have a PartitionsDefinition containing the passed partition key `photos`"


def write_source(work: Path) -> Path:
    """`photos`: 2 real photos in an image folder, and its catalog."""
    folder = work / "photos"
    folder.mkdir(parents=True)
    for i, photo in enumerate([p for p in load_skimage_photos() if p.image.mode == "RGB"][:2]):
        photo.image.resize((512, 512), Image.Resampling.BICUBIC).save(folder / f"img_{i}.jpg", quality=90)
    catalog = work / "sources.yaml"
    catalog.write_text(f"sources:\n- {{name: photos, format: imagefolder, uri: {folder}}}\n")
    return catalog


def dagster_materialize(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([DAGSTER, "asset", "materialize", "-m", "prx_assets.definitions", "--select", "samples",
                           "--partition", "photos"], capture_output=True, text=True, timeout=600, env=cli_env(**env),
                          cwd=REPO, start_new_session=True)


@pytest.mark.slow
def test_dagster_cli_materializes_a_partition_once_sources_are_synced(tmp_path: Path) -> None:
    catalog, root, home = write_source(tmp_path), tmp_path / "corpus", tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    env = {"DAGSTER_HOME": str(home), "PRX_ROOT": str(root), "PRX_SOURCES": str(catalog)}

    refused = dagster_materialize(env)
    assert refused.returncode != 0 and NOT_A_PARTITION in refused.stderr, refused.stderr[-3000:]
    assert not (root / "lance").exists()

    synced = run_cli("sources", "sync", "--sources", str(catalog), "--root", str(root), DAGSTER_HOME=str(home))
    assert synced.returncode == 0, synced.explain()
    assert synced.stdout.splitlines()[:2] == [f"dagster home {home}",
                                              "partitions of `sources`: photos (added photos; removed none)"]
    assert not (root / "_state").exists()  # DAGSTER_HOME wins over the root's own home

    done = dagster_materialize(env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RUN_SUCCESS" in done.stderr, done.stderr[-3000:]
    rows = lance.dataset(str(root / "lance" / "samples.lance")).to_table(columns=["source"]).to_pylist()
    assert rows == [{"source": "photos"}] * 2

    again = run_cli("sources", "sync", "--sources", str(catalog), "--root", str(root), DAGSTER_HOME=str(home))
    assert "partitions of `sources`: photos (added none; removed none)" in again.stdout, again.explain()


def test_sources_sync_without_a_home_uses_the_roots_own(tmp_path: Path) -> None:
    catalog, root = write_source(tmp_path), tmp_path / "corpus"
    synced = run_cli("sources", "sync", "--sources", str(catalog), "--root", str(root))
    assert synced.returncode == 0, synced.explain()
    assert synced.stdout.splitlines()[0] == f"dagster home {root / '_state' / 'dagster'}", synced.explain()
    assert (root / "_state" / "dagster" / "dagster.yaml").exists()
    assert not any(line.startswith("warning: ") for line in synced.output.splitlines()), synced.explain()


def test_each_root_has_its_own_default_home(tmp_path: Path) -> None:
    assert default_home(str(tmp_path / "a")) == tmp_path / "a" / "_state" / "dagster"
    assert default_home(str(tmp_path / "a" / ".." / "a")) == tmp_path / "a" / "_state" / "dagster"
    s3 = default_home("s3://bucket/corpus")
    assert s3.parent == REPO / ".prx" / "dagster" and re.fullmatch(r"[0-9a-f]{16}", s3.name)
    assert default_home("s3://bucket/corpus/") == s3 and default_home("s3://bucket/other") != s3
    assert corpus_root("s3://bucket/corpus/") == "s3://bucket/corpus"


def make_env(variable: str, *args: str) -> dict[str, str]:
    """The environment a Makefile variable (DEMO_ENV, UI_ENV) gives, with `args` on make's command line."""
    shown = subprocess.run(["make", "-s", "--no-print-directory", f"--eval=prx-env: ; @echo $({variable})", "prx-env",
                            *args], capture_output=True, text=True, timeout=60, cwd=REPO, check=True).stdout
    return dict(item.split("=", 1) for item in shown.split())


def test_make_demo_and_make_ui_share_the_demo_roots_own_home() -> None:
    """`make demo` runs with DEMO_ENV, whose DAGSTER_HOME is the home `prx-corpus build --root` picks for the
    demo root; `make ui` with no arguments runs with the same settings, and with ROOT its root's own home."""
    env = make_env("DEMO_ENV")
    assert Path(env["DAGSTER_HOME"]) == default_home(env["PRX_ROOT"]), env
    assert make_env("UI_ENV") == env
    mine = make_env("UI_ENV", "ROOT=/data/corpus", "SOURCES=/data/sources.yaml")
    assert (mine["PRX_ROOT"], mine["DAGSTER_HOME"]) == ("/data/corpus", str(default_home("/data/corpus")))
    assert mine["PRX_SOURCES"] == "/data/sources.yaml" and mine["PRX_CONFIG"] != env["PRX_CONFIG"]
    makefile = (REPO / "Makefile").read_text()
    for target, variable in (("demo", "$(DEMO_ENV)"), ("ui", "$(UI_ENV)")):
        body = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M)[1]
        assert variable in body, body


def test_a_fresh_shell_gets_one_line_naming_the_missing_settings_and_sync_prints_them_all(tmp_path: Path) -> None:
    """Without PRX_ROOT and PRX_SOURCES the definitions no longer fall back to the demo's root: Dagster's
    CLI stops with one line naming them; the command `sources sync` prints carries every setting the
    definitions read (the config file too), and Dagster loads the definitions with exactly that."""
    fresh = dagster_materialize({})
    lines = [line for line in fresh.stderr.splitlines() if "Warning" not in line and "return callback" not in line]
    assert fresh.returncode == 2 and len(lines) == 1, fresh.stderr[-3000:]
    assert lines[0].startswith("prx_assets.definitions: error: PRX_ROOT and PRX_SOURCES are not set: "), lines
    assert "Traceback" not in fresh.stderr

    catalog, root, config = write_source(tmp_path), tmp_path / "corpus", tmp_path / "prx.yaml"
    config.write_text("training: {global_batch_size: 4}\n")
    synced = run_cli("sources", "sync", "--sources", str(catalog), "--root", str(root), "--config", str(config))
    assert synced.returncode == 0, synced.explain()
    command = synced.stdout.splitlines()[-1].removeprefix("e.g. ")
    env = dict(item.split("=", 1) for item in command.split(" dagster ")[0].split())
    assert env == {"DAGSTER_HOME": str(root / "_state" / "dagster"), "PRX_ROOT": str(root), "PRX_SOURCES": str(catalog),
                   "PRX_CONFIG": str(config)}, command
    loaded = subprocess.run([DAGSTER, "definitions", "validate", "-m", "prx_assets.definitions"], capture_output=True,
                            text=True, timeout=600, env=cli_env(**env), cwd=tmp_path, start_new_session=True)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
