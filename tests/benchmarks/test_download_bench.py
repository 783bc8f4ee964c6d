"""`prx-bench download` at a tiny size, as an operator runs it (its own process and Ray):
both rates measured on the same rows, every image fetched and ingested. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).with_name("prx-bench"))


def test_a_tiny_download_benchmark_reports_both_rates(tmp_path: Path) -> None:
    out = tmp_path / "download.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    done = subprocess.run([CLI, "download", "--images", "30", "--files", "3", "--cpus", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    for name in ("plain", "download"):
        assert (results[name]["rows"], results[name]["rejected"], results[name]["units"]) == (30, 0, 3), name
        assert results[name]["images_per_s"] > 0 and results[name]["seconds"] > 0
    assert results["ratio"] > 0 and results["cpus"] == 1
    assert results["fetch_only"]["fetched"] == 30 and results["fetch_only"]["images_per_s"] > 0
    assert "download + ingest runs at" in done.stdout
