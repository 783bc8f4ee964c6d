"""Crashing a stage at a chosen moment, for the resume tests: a driver in its own session, killed
with SIGKILL once it says it paused at a named point (prx_core.compute.faults)."""

from __future__ import annotations


def kill_at(point: str, script: str, *args: str, timeout: float = 300) -> None:
    """Run `python -c script *args` with PRX_PAUSE_AT=point in its own session, wait until its
    driver says it paused there, then SIGKILL the whole session (a crash at a chosen moment)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from prx_core.compute.faults import MARKER

    proc = subprocess.Popen([sys.executable, "-c", script, *args], env={**os.environ, "PRX_PAUSE_AT": point},
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline, seen = time.monotonic() + timeout, []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(f"{MARKER} {point}") or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert any(line.startswith(f"{MARKER} {point}") for line in seen), "".join(seen[-30:])


def recorded_units(storage_root: str, asset: str, partition: str, prefix: str = "") -> list[str]:
    """The unit ids the killed attempt recorded, once the units its cluster still ran are over (see
    `settled_counts`). A record being written when the kill came is a hidden temp file
    (put_atomic), not a record: only `<unit>.json` files count."""
    from pathlib import Path

    from benchmarks.settle import settled_counts
    from prx_core.compute.units import RUNS

    (attempt,) = Path(storage_root, RUNS, asset, partition).iterdir()
    settled_counts(attempt, prefix)
    return sorted(p.stem for p in (attempt / "done").glob(f"{prefix}*.json"))
