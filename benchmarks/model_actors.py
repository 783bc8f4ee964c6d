"""What keeping model actors between stage runs saves on one `prx-corpus build` (prx_core.compute.actors).

The same build of the same sources, alternately with `PRX_IDLE_ACTOR_SECONDS=0` (every actor ends
with its run: the baseline, what every build did before actors outlived their run) and the default
(idle actors wait for the next model run), `--repeats` times each, in one run, each build on a fresh
corpus root. Per build: wall seconds, and the CPU-seconds of the whole process tree (the CLI, its
embedded Ray, every worker and actor) where a cgroup-v1 `cpuacct` group can be made (root), else
none. The two kinds of build must print the same summary table.

    python -m benchmarks.model_actors [--sources CATALOG] [--repeats 2] [--dir DIR] [--json FILE]

Without `--sources`, the demo sources (`prx-corpus demo-sources`) are written under the work folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CLI = str(Path(sys.executable).with_name("prx-corpus"))
ACCT = Path("/sys/fs/cgroup/cpuacct")
KINDS = {"baseline": "0", "kept": None}  # PRX_IDLE_ACTOR_SECONDS per kind (None: the default)


def cpu_group(name: str) -> Path | None:
    """A fresh cpuacct group, or None where this machine does not let us make one."""
    group = ACCT / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cpuacct.usage").write_text("0")
    except OSError:
        return None
    return group


def run_build(catalog: Path, work: Path, kind: str) -> dict[str, Any]:
    """One `prx-corpus build` of `catalog` into a fresh root under `work`, timed."""
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PRX_ROOT", "PRX_SOURCES", "PRX_CONFIG",
                                                            "RAY_ADDRESS", "PRX_IDLE_ACTOR_SECONDS")}
    if KINDS[kind] is not None:
        env["PRX_IDLE_ACTOR_SECONDS"] = KINDS[kind]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    group = cpu_group(f"prx-bench-{os.getpid()}")
    joined = (lambda: (group / "cgroup.procs").write_text(str(os.getpid()))) if group else None
    start = time.monotonic()
    done = subprocess.run([CLI, "build", "--sources", str(catalog), "--root", str(work / "corpus"), "--dagster-home",
                           str(work / "dagster")], capture_output=True, text=True, env=env, preexec_fn=joined)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    cpu = int((group / "cpuacct.usage").read_text()) / 1e9 if group else None
    lines = done.stdout.splitlines()  # the summary table: from its header to its `total` row
    first = next(i for i, line in enumerate(lines) if line.startswith("source "))
    last = next(i for i in range(first, len(lines)) if lines[i].startswith("total"))
    return {"kind": kind, "seconds": round(seconds, 1), "cpu_seconds": None if cpu is None else round(cpu, 1),
            "summary": lines[first:last + 1]}


def run(catalog: Path, work: Path, repeats: int) -> dict[str, Any]:
    builds = [run_build(catalog, work / f"{kind}-{n}", kind) for n in range(repeats) for kind in KINDS]
    medians = {kind: {measure: statistics.median(b[measure] for b in builds if b["kind"] == kind)
                      if all(b[measure] is not None for b in builds) else None
                      for measure in ("seconds", "cpu_seconds")} for kind in KINDS}
    ratios = {measure: round(medians["kept"][measure] / medians["baseline"][measure], 2)
              if medians["baseline"][measure] else None for measure in ("seconds", "cpu_seconds")}
    same = all(b["summary"] == builds[0]["summary"] for b in builds)
    return {"catalog": str(catalog), "repeats": repeats, "builds": builds, "medians": medians,
            "kept_over_baseline": ratios, "same_summary": same}


def format_table(results: dict[str, Any]) -> str:
    lines = ["| build | wall s | CPU s |", "|---|---|---|"]
    for b in results["builds"]:
        lines.append(f"| {b['kind']} | {b['seconds']} | {b['cpu_seconds'] if b['cpu_seconds'] is not None else '-'} |")
    ratios = results["kept_over_baseline"]
    lines.append(f"\nkept / baseline (medians): wall {ratios['seconds']}x, CPU {ratios['cpu_seconds']}x; "
                 f"same summary: {results['same_summary']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=Path, help="a catalog (default: the demo sources, written here)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, help="the work folder (default: a temporary one, deleted)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = args.dir or Path(tempfile.mkdtemp(prefix="prx-model-actors-"))
    try:
        catalog = args.sources
        if catalog is None:
            subprocess.run([CLI, "demo-sources", str(work / "demo")], check=True, capture_output=True)
            catalog = work / "demo" / "sources.yaml"
        results = run(catalog, work / "builds", args.repeats)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
