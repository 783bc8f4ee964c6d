"""`prx-corpus build` starts its embedded Ray with the configured `ray.ray_init_options`: the CLI
starts Ray before any Dagster resource does (the resources then reuse it), so options only the
resource read were silently dropped. Observed through `_temp_dir`, where Ray writes its session:
a build of `raw_source` alone (the cheapest stage that runs with Ray started) of a 5-file folder.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from test_build import CLI, cli_env
from test_build_report import write_source

pytestmark = pytest.mark.slow


def test_the_embedded_ray_starts_with_the_configured_init_options(tmp_path: Path) -> None:
    catalog = write_source(tmp_path)
    ray_dir = Path(tempfile.mkdtemp(prefix="prxray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    try:
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"ray": {"ray_init_options": {"_temp_dir": str(ray_dir), "num_cpus": 1}}}))
        done = subprocess.run([CLI, "build", "--sources", str(catalog), "--root", str(tmp_path / "corpus"),
                               "--dagster-home", str(tmp_path / "home"), "--config", str(config), "--select",
                               "raw_source", "--no-preflight"], capture_output=True, text=True, timeout=600,
                              env=cli_env())
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        sessions = [p for p in ray_dir.glob("session_*") if p.name != "session_latest"]
        assert len(sessions) == 1, sorted(p.name for p in ray_dir.iterdir())
        assert (sessions[0] / "logs").is_dir()
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
