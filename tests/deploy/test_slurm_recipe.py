"""deploy/slurm/prx-build.sbatch, rehearsed offline (issue 43): with `scontrol`, `srun` and
`hostname` stubs that record instead of run, the script starts a Ray head on the first allocated
node, joins every other node to it, runs `prx-corpus build` on the head with arguments the real
CLI accepts, and stops Ray on every node at exit, also when the build fails. Ray itself on a
cluster started this way (`ray: {address}` without a job server) is tests/e2e/test_plain_cluster.py's."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from prx_cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "slurm" / "prx-build.sbatch"
NODES = ("node-a", "node-b", "node-c")


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


def rehearse(tmp_path: Path, build_exit: int = 0) -> tuple[int, list[list[str]]]:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    stub(bin_dir, "scontrol", 'echo "' + "\n".join(NODES) + '"')
    # srun records its command line in one write (the workers' sruns run at once: two writes each
    # interleaved into one line); the build step exits as asked, the rest succeed
    stub(bin_dir, "srun", f'line=$(printf "%q " "$@"); echo "$line" >> {log}\n'
                          f'case "$*" in *prx-corpus*) exit {build_exit};; *"hostname --ip-address"*) echo 10.0.0.1;; esac')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-c]",
           "SLURM_CPUS_ON_NODE": "32", "SLURM_GPUS_ON_NODE": "8", "PRX_HOME": str(REPO), "SOURCES": "/shared/sources.yaml",
           "ROOT": "s3://bucket/corpus", "CONFIG": "/shared/prx-config.yaml", "RAY_WAIT_SECONDS": "1"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    calls = [shlex.split(line) for line in log.read_text().splitlines() if line.strip()]
    return done.returncode, calls


def test_the_script_parses_and_asks_slurm_for_whole_nodes() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    header = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in header and "#SBATCH --exclusive" in header


@pytest.mark.parametrize("build_exit", [0, 1])
def test_a_rehearsal_starts_the_cluster_builds_and_stops_it(tmp_path: Path, build_exit: int) -> None:
    code, calls = rehearse(tmp_path, build_exit)
    assert code == build_exit
    bin_ray = str(REPO / ".venv" / "bin" / "ray")
    head = next(c for c in calls if bin_ray in c and "--head" in c)
    assert head[head.index("-w") + 1] == "node-a" and "--port=6379" in head and "--node-ip-address=10.0.0.1" in head
    assert "--num-cpus=32" in head and "--num-gpus=8" in head and "--block" in head
    workers = [c for c in calls if bin_ray in c and "--address=10.0.0.1:6379" in c]
    assert sorted(c[c.index("-w") + 1] for c in workers) == ["node-b", "node-c"]
    (build,) = [c for c in calls if any(a.endswith("/prx-corpus") for a in c)]
    assert build[build.index("-w") + 1] == "node-a" and "RAY_ADDRESS=10.0.0.1:6379" in build and "--overlap" in build
    args = build[next(i for i, a in enumerate(build) if a.endswith("/prx-corpus")) + 1:]
    parsed = build_parser().parse_args(args)  # the real CLI takes them
    assert (parsed.command, parsed.sources, parsed.root, parsed.config) == (
        "build", "/shared/sources.yaml", "s3://bucket/corpus", "/shared/prx-config.yaml")
    (stop,) = [c for c in calls if c[-2:] == ["stop", "--force"]]
    assert "--nodes=3" in stop and calls.index(stop) > calls.index(build)  # at exit, on every node, whatever the build did
