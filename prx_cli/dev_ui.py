"""`make ui`: `dagster dev` that stops on Ctrl-C, and leaves nothing running behind it.

`dagster dev` handles Ctrl-C by asking its webserver and daemon to shut down and waiting up to
60 s for each; a daemon in the middle of a tick, or a run it launched, keeps it there, and a
second Ctrl-C or a SIGTERM does not shorten the wait. Its code servers outlive it by their
heartbeat timeout (30-45 s) and a run's embedded Ray with them. Here `dagster dev` runs in a session
of its own, so the terminal's Ctrl-C reaches only this wrapper, which forwards one SIGINT (Dagster's
own clean shutdown: runs are marked interrupted, their recorded work units stay recorded), waits
`GRACE_S`, then kills every process of that session, by id; a second Ctrl-C kills them at once.
`python -m prx_cli.dev_ui <dagster dev arguments>`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 15.0  # after the first Ctrl-C: Dagster's own shutdown, then the session is killed
POLL_S = 0.2


def session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (Linux /proc; stat's 6th field is the session id)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def kill_session(sid: int, wait_s: float = 10.0) -> None:
    """SIGKILL every process of session `sid` and wait until the kernel has reaped them all: a killed
    process stays listed while it exits, and `make ui` must not return before it is gone."""
    deadline = time.monotonic() + wait_s
    while (pids := session_pids(sid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def run(args: list[str], grace: float = GRACE_S) -> int:
    dagster = str(Path(sys.executable).with_name("dagster"))
    proc = subprocess.Popen([dagster, "dev", *args], start_new_session=True)
    stopping: list[float] = []  # when the first stop signal came

    def stop(signum: int, _frame: object) -> None:
        if stopping:  # a second Ctrl-C: no more waiting
            kill_session(proc.pid)
            return
        stopping.append(time.monotonic())
        print(f"\nstopping dagster dev (at most {grace:.0f} s; Ctrl-C again to stop it now)", file=sys.stderr, flush=True)
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    while proc.poll() is None:
        if stopping and time.monotonic() - stopping[0] > grace:
            print("dagster dev did not stop in time: killing it", file=sys.stderr, flush=True)
            kill_session(proc.pid)
        time.sleep(POLL_S)
    kill_session(proc.pid)  # its code servers, run workers and their Ray: nothing outlives `make ui`
    return 0 if stopping else proc.returncode


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
