"""`make ui` on a fresh instance, in a real headless Chromium: the automation condition sensor is
RUNNING without anyone turning it on, and `dagster dev` starts without its "superseded" warning.

The command is the Makefile's own (`make -n ui`, run without its `setup` prerequisite) with DEMO
pointing at a throwaway folder holding a one-photo catalog and no corpus yet, UI_PORT at a free
loopback port, and CONFIG at demo-config.yaml plus a condition sensor ticking every TICK_S seconds
(not 30: the daemon's ticks are what the tests wait for): the DAGSTER_HOME it names does not exist before. ~60-90 s on 2 busy cores
(dagster dev's webserver, daemon and code server each import the definitions).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
from PIL import Image
from playwright.sync_api import Page, expect, sync_playwright
from postgres_server import free_port
from test_build import cli_env

from prx_assets.settings import REPO
from prx_core.demo.photos import load_skimage_photos

pytestmark = pytest.mark.slow

SENSOR = "automation_condition_sensor"
# as tests/explorer/test_browser.py: Debian's Chromium, which must not dial out on a closed network
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
SHOTS = REPO / "test-artifacts" / "ui"
TICK_S = 5  # automation.condition_interval_s; the daemon's loop adds up to 5 s per tick


@dataclass
class UI:
    url: str
    home: Path
    log: Path
    proc: subprocess.Popen
    config: Path  # PRX_CONFIG

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def make_ui_commands(demo: Path, port: int, config: Path) -> str:
    """The `ui` target's recipe as make would run it, without the `setup` prerequisite."""
    shown = subprocess.run(["make", "-s", "-n", "--no-print-directory", "ui", f"DEMO={demo}", f"UI_PORT={port}",
                            f"CONFIG={config}"],
                           capture_output=True, text=True, cwd=REPO, timeout=60, check=True).stdout
    lines = shown.splitlines()
    assert lines[0] == "bash scripts/setup.sh", shown
    return "\n".join(lines[1:])


def stop(proc: subprocess.Popen) -> None:
    """dagster dev and everything it started (its own session): SIGINT as Ctrl-C, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the session
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UI]:
    demo = tmp_path_factory.mktemp("ui") / "demo"
    (demo / "sources" / "photos").mkdir(parents=True)
    photo = next(p for p in load_skimage_photos() if p.image.mode == "RGB")
    photo.image.resize((512, 512), Image.Resampling.BICUBIC).save(demo / "sources" / "photos" / "img_0.jpg", quality=90)
    (demo / "sources" / "sources.yaml").write_text("sources:\n- {name: photos, format: imagefolder, uri: photos}\n")
    config = demo / "config.yaml"
    config.write_text((REPO / "demo-config.yaml").read_text() + f"automation: {{condition_interval_s: {TICK_S}}}\n")
    home = demo / "corpus" / "_state" / "dagster"
    assert not home.exists()
    port = free_port()
    log = demo.parent / "dagster-dev.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", make_ui_commands(demo, port, config)], stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO, env=cli_env(), start_new_session=True)
    started = UI(f"http://127.0.0.1:{port}", home, log, proc, config)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{started.url}/server_info", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"make ui did not serve {started.url}:\n{started.output()[-5000:]}")
                time.sleep(1)
        yield started
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def page(ui: UI) -> Iterator[Page]:
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        yield context.new_page()
        context.close()
        browser.close()


def switch_of(page: Page, kind: str, name: str):
    """The on/off switch of one row of the Automation page (the last checkbox of the row; the first selects it)."""
    row = page.locator("[data-index]", has=page.locator(f'a[href$="/{kind}/{name}"]'))
    switch = row.locator("input[type=checkbox]").last
    deadline = time.monotonic() + 60
    while not switch.is_enabled():  # disabled until the row's state has loaded
        assert time.monotonic() < deadline, f"the switch of {name} stayed disabled"
        page.wait_for_timeout(250)
    return switch


def test_the_automation_condition_sensor_runs_on_a_fresh_instance(ui: UI, page: Page) -> None:
    assert (ui.home / "dagster.yaml").read_text() == (REPO / "dagster.yaml").read_text()  # the fresh home make ui made
    page.goto(f"{ui.url}/automation")
    page.get_by_text(SENSOR, exact=True).first.wait_for(timeout=90_000)
    try:
        expect(switch_of(page, "sensors", SENSOR)).to_be_checked(timeout=30_000)
        expect(switch_of(page, "sensors", "sources_sensor")).to_be_checked(timeout=30_000)
        expect(switch_of(page, "schedules", "weekly_source_refresh")).not_to_be_checked()  # schedules stay stopped
        assert page.get_by_text("default_automation_condition_sensor").count() == 0  # ours covers every asset
    finally:
        skip = page.get_by_role("button", name="Skip")  # the community dialog a fresh instance opens once
        if skip.count() and skip.first.is_visible():
            skip.first.click()
        page.screenshot(path=str(SHOTS / "automation.png"), full_page=True)

    # and the daemon evaluates it: one tick over the eager assets, nothing to launch on an empty corpus
    deadline = time.monotonic() + 120
    while not re.search(rf"Finished auto-materialization tick for {SENSOR}", ui.output()):
        assert time.monotonic() < deadline, f"the daemon never ticked {SENSOR}:\n{ui.output()[-5000:]}"
        time.sleep(1)


def test_make_ui_starts_without_dagster_dev_warnings(ui: UI, page: Page) -> None:
    output = ui.output()
    assert "Serving dagster-webserver" in output, output[-3000:]
    assert "superseded" not in output and "dg dev" not in output, output[-3000:]
    assert "will not be used to configure Dagster" not in output, output[-3000:]  # the checkout's dagster.yaml


def test_descriptions_render_as_written(ui: UI, page: Page) -> None:
    """A path with placeholders reads as written on the asset's page (a code span: Markdown took
    `<root>` for an HTML tag before). The kinds per asset: tests/assets/test_raw_source_rows.py."""
    page.goto(f"{ui.url}/assets/mds_shards")
    path = page.locator("code", has_text="<root>/mds/<source>/<tier>/<w>x<h>")
    expect(path.first).to_be_visible(timeout=90_000)
    page.screenshot(path=str(SHOTS / "mds_shards.png"), full_page=True)
    page.goto(f"{ui.url}/assets/skip_lists")
    expect(page.locator("code", has_text="<root>/skiplists/<source>/...").first).to_be_visible(timeout=90_000)


def dagster_materialize(ui: UI, select: str) -> subprocess.CompletedProcess:
    """Dagster's own CLI on make ui's instance and settings (the environment `sources sync` prints)."""
    env = cli_env(DAGSTER_HOME=str(ui.home), PRX_ROOT=str(ui.home.parents[1]),
                  PRX_SOURCES=str(ui.home.parents[2] / "sources" / "sources.yaml"), PRX_CONFIG=str(ui.config))
    return subprocess.run([str(REPO / ".venv" / "bin" / "dagster"), "asset", "materialize", "-m", "prx_assets.definitions",
                           "--select", select, "--partition", "photos"], capture_output=True, text=True, timeout=600,
                          env=env, cwd=REPO, start_new_session=True)


def automation_runs(ui: UI) -> list[dg.DagsterRun]:
    """The runs the daemon's automation condition sensor launched, oldest first."""
    with dg.DagsterInstance.from_config(str(ui.home)) as instance:
        runs = instance.get_runs(dg.RunsFilter(tags={"dagster/from_automation_condition": "true"}))
        return sorted(runs, key=lambda run: instance.get_run_record_by_id(run.run_id).create_timestamp)


def ticks_after(ui: UI, mark: int, count: int, timeout: float = 240) -> list[str]:
    """The daemon's next `count` ticks of the condition sensor after log offset `mark`: their 'Tick produced' lines."""
    deadline = time.monotonic() + timeout
    while True:
        done = re.findall(rf"Tick produced (\d+) runs .* for {SENSOR}", ui.output()[mark:])
        if len(done) >= count:
            return done
        assert time.monotonic() < deadline, f"the daemon ticked {len(done)} times:\n{ui.output()[mark:][-4000:]}"
        time.sleep(2)


def test_the_daemon_reruns_nothing_after_a_materialization_that_changed_no_data(ui: UI, page: Page) -> None:
    """On make ui's real daemon: new `samples` data makes the automation sensor run `buckets` (eager on new
    data); materializing `samples` again over an unchanged source keeps its data version ("unchanged: nothing
    to run"), and the sensor's next ticks launch nothing (Dagster's eager() relaunched the downstream assets)."""
    first = dagster_materialize(ui, "raw_source,samples")
    assert first.returncode == 0, first.stderr[-3000:]
    deadline = time.monotonic() + 300
    while not [r for r in automation_runs(ui) if r.status == dg.DagsterRunStatus.SUCCESS]:
        assert time.monotonic() < deadline, f"no automation run after new samples:\n{ui.output()[-4000:]}"
        time.sleep(3)
    (launched,) = automation_runs(ui)
    assert launched.asset_selection == {dg.AssetKey("buckets")}, launched.asset_selection

    again = dagster_materialize(ui, "samples")
    assert again.returncode == 0 and "unchanged" in again.stderr, again.stderr[-3000:]
    # three ticks after the unchanged materialization: the first may have begun before it was recorded, the
    # next two evaluated it (eager() relaunched on the first of them); TICK_S apart, not 30 s
    produced = ticks_after(ui, len(ui.output()), 3)
    assert produced == ["0", "0", "0"] and len(automation_runs(ui)) == 1, (produced, automation_runs(ui))
    with dg.DagsterInstance.from_config(str(ui.home)) as instance:  # the daemon ticked at CONFIG's interval
        (state,) = [s for s in instance.all_instigator_state() if s.name == SENSOR]
        assert state.instigator_data.min_interval == TICK_S, state.instigator_data


def test_make_ui_stops_on_ctrl_c_leaving_nothing_behind(ui: UI, page: Page) -> None:
    """Last in the module: one Ctrl-C (SIGINT to make's process group, as a terminal sends it) stops
    `make ui` within prx_cli.dev_ui's grace, and no process of dagster dev's session (code servers,
    run workers, their Ray) is left; before, dagster dev could wait 60 s per service and its code
    servers outlived it by their heartbeat timeout."""
    from prx_cli.dev_ui import GRACE_S, session_pids

    port = ui.url.rsplit(":", 1)[1]
    dev = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).startswith(f"{REPO}/.venv/bin/")
           and " dev -m prx_assets.definitions " in _cmdline(p) and _cmdline(p).endswith(f" -p {port}")]
    assert len(dev) == 1, [(p.name, _cmdline(p)) for p in dev]
    sid = int(dev[0].name)  # dev_ui starts it in a session of its own
    assert len(session_pids(sid)) >= 3  # dagster dev, its webserver, daemon and code servers
    started = time.monotonic()
    os.killpg(ui.proc.pid, signal.SIGINT)
    ui.proc.wait(GRACE_S + 20)
    took = time.monotonic() - started
    assert session_pids(sid) == [], [(pid, _cmdline(Path(f"/proc/{pid}"))) for pid in session_pids(sid)]
    assert "stopping dagster dev" in ui.output(), ui.output()[-3000:]
    print(f"make ui stopped {took:.1f} s after one SIGINT")


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
