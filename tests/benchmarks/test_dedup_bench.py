"""`prx-bench dedup` on a few pictures, as an operator runs it: the labelled real photos
through `prx-corpus build` (samples, phashes, duplicates), scored against the labels and against
imagehash. The whole set's figures are in docs/benchmarks.md; here every copy of every picture must
be found, no group may join two pictures, and every keeper must be one of its group's best copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.dedup_set import DUPLICATE_KINDS

CLI = str(Path(sys.executable).with_name("prx-bench"))


def test_a_small_dedup_benchmark_finds_every_copy_and_merges_nothing(tmp_path: Path) -> None:
    out = tmp_path / "dedup.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    done = subprocess.run([CLI, "dedup", "--pictures", "10", "--rules", "keys", "--workdir", str(tmp_path / "w"),
                           "--json", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    keys = results["pipeline_keys"]
    assert results["pictures"] >= 10 and results["kinds"]["original"] == 10
    assert set(keys["recall"]) == set(DUPLICATE_KINDS) and all(r == 1.0 for r in keys["recall"].values()), keys
    assert keys["merged_groups"] == 0 and keys["keeper_right"] and keys["copies_left_per_picture"] == 1.0
    assert "pipeline_phash" not in results
    peer = results["imagehash_r0"]  # the peer runs on the same files: its recall is measured, whatever it is
    assert 0 < peer["recall_reencodes"] <= 1 and peer["recall"]["byte_copy"] == 1.0
    assert "recall jpeg_q75" in done.stdout and "imagehash r<=4" in done.stdout
