"""The embedded Ray listens on loopback only (prx_core.compute.loopback).

Each test starts Ray in a child process the way the product does (`prx-corpus build` through
`start_ray()`, a Dagster run through the `EmbeddedRay` resource), then reads which sockets that
process and every process under it listen on, from /proc (the tables of /proc/net, the socket
inodes under /proc/<pid>/fd). Ray 2.60 bound its GCS, raylet, workers and dashboard agent to all
interfaces, and its runtime-env agent, metrics exporters and autoscaler monitor to the host's
routable address, until the start put its node on 127.0.0.1.

The two metrics servers have fixed ports (44217, 44227) that another Ray on a shared machine
often holds: the child gets free ones through Ray's own variables, so they are seen here. The
dashboard agent's HTTP port (52365, fixed, not configurable through `ray.init`) is checked
whenever it is free; when another Ray holds it, this Ray's agent serves without it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prx_core.compute.loopback import (
    LOOPBACK,
    NODE_IP_OPTION,
    VLLM_HOST_IP,
    is_loopback,
    joins_loopback,
    loopback_node,
    wants_loopback,
)

MARK = "PRX-LOOPBACK "
CHILD = r"""
import contextlib, json, os, sys
import ray

resources = contextlib.ExitStack()
if sys.argv[1] == "cli":  # what `prx-corpus build` does without a configured cluster
    from prx_core.compute.quiet import start_ray
    start_ray()
else:  # what a Dagster run does with the definitions' default resource
    import dagster as dg
    from prx_resources.ray import EmbeddedRay, never_cleanup
    resources.enter_context(dg.build_resources({"ray": EmbeddedRay(lifecycle=never_cleanup())}))
assert ray.is_initialized()  # started above, not by the first task below

@ray.remote
def worker_view():
    return os.environ.get("VLLM_HOST_IP"), ray.util.get_node_ip_address()

vllm_host, worker_ip = ray.get(worker_view.remote())
print("PRX-LOOPBACK " + json.dumps({"node_ip": ray._private.worker._global_node.node_ip_address,
      "gcs": ray.get_runtime_context().gcs_address,
      "worker_ip": worker_ip, "worker_vllm_host": vllm_host, "driver_vllm_host": os.environ.get("VLLM_HOST_IP")}),
      flush=True)
sys.stdin.readline()
resources.close()
ray.shutdown()
"""
# A second driver joining that Ray by the loopback address it reports, as the tests' crash drivers do.
JOIN = r"""
import sys
import ray
from prx_core.compute.quiet import start_ray

start_ray(sys.argv[1], log_to_driver=False)
print("PRX-LOOPBACK", ray.get(ray.remote(lambda: 41 + 1).remote()), ray._private.worker._global_node.node_ip_address)
"""
# What must be seen listening, so that "nothing off loopback" is not vacuous.
EXPECTED = {"driver", "gcs_server", "raylet", "worker", "ray::DashboardAgent", "ray::RuntimeEnvAgent",
            "monitor.py", "dashboard.py"}
TABLES = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}  # LISTEN; an unconnected UDP socket


def address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening(pid: int) -> dict[int, tuple[str, str, int]]:
    """Socket inode -> (table, address, port) of every listening socket in `pid`'s network namespace."""
    found: dict[int, tuple[str, str, int]] = {}
    for table, state in TABLES.items():
        path = Path(f"/proc/{pid}/net/{table}")
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            fields = line.split()
            if fields[3] == state:
                ip, port = fields[1].split(":")
                found[int(fields[9])] = (table, address(ip), int(port, 16))
    return found


def tree(root: int) -> list[int]:
    """`root` and every process under it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    pids, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        pids += frontier
    return pids


def component(pid: int, root: int) -> str:
    if pid == root:
        return "driver"
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    script = next((Path(a).name for a in argv[1:] if a.endswith(".py")), None)
    name = Path(argv[0].split()[0]).name if argv[0] else ""
    if name.startswith("ray::") and name not in ("ray::DashboardAgent", "ray::RuntimeEnvAgent"):
        return "worker"  # ray::IDLE or the task it runs
    return script if name.startswith("python") and script else name


def listeners(root: int) -> set[tuple[str, str, str, int]]:
    """(component, table, address, port) for each socket the processes of `root`'s tree listen on."""
    sockets = listening(root)
    seen = set()
    for pid in tree(root):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            name = component(pid, root)
        except OSError:
            continue  # it exited meanwhile
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in sockets:
                seen.add((name, *sockets[int(link[8:-1])]))
    return seen


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def run_embedded(how: str) -> tuple[dict, set[tuple[str, str, str, int]]]:
    """Start the child, wait for its report, collect its tree's listeners until every expected
    component was seen (at most 90 s), then let it shut Ray down."""
    env = {k: v for k, v in os.environ.items() if k not in (VLLM_HOST_IP, "RAY_ADDRESS")}
    env.update(AUTOSCALER_METRIC_PORT=str(free_port()), DASHBOARD_METRIC_PORT=str(free_port()))
    child = subprocess.Popen([sys.executable, "-c", CHILD, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    watchdog = threading.Timer(300, os.killpg, (child.pid, signal.SIGKILL))
    watchdog.start()
    try:
        line = ""
        while not line.startswith(MARK):
            line = child.stdout.readline()  # type: ignore[union-attr]
            if not line:
                pytest.fail(f"the embedded Ray did not start: {child.stderr.read()[-3000:]}")  # type: ignore[union-attr]
        report = json.loads(line[len(MARK):])
        seen: set[tuple[str, str, str, int]] = set()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not EXPECTED <= {s[0] for s in seen}:
            seen |= listeners(child.pid)
            time.sleep(0.5)
        seen |= listeners(child.pid)
        # RAY_AUTH_MODE=token: what a process the embedding one starts inherits (ray.init sets it there)
        try:
            joined = subprocess.run([sys.executable, "-c", JOIN, report["gcs"]], capture_output=True, text=True,
                                    timeout=180, env={**env, "RAY_AUTH_MODE": "token"})
            report["joined"] = next((line for line in joined.stdout.splitlines() if line.startswith(MARK)),
                                    joined.stderr[-2000:])
        except subprocess.TimeoutExpired:
            report["joined"] = "the joining driver did not connect within 180 s"
        child.communicate("\n", timeout=120)
        return report, seen
    finally:
        watchdog.cancel()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)  # only the session this test started


@pytest.mark.parametrize("how", ["cli", "dagster"])
def test_no_embedded_ray_process_listens_off_loopback(how: str) -> None:
    report, seen = run_embedded(how)
    exposed = sorted(s for s in seen if not is_loopback(s[2]))
    assert exposed == [], f"listening off loopback: {exposed}"
    assert EXPECTED <= {s[0] for s in seen}, f"expected listeners missing; seen {sorted(seen)}"
    assert report["node_ip"] == report["worker_ip"] == LOOPBACK
    assert report["worker_vllm_host"] == LOOPBACK  # vLLM's host IP agrees with Ray's node IP
    assert report["driver_vllm_host"] is None  # the driver's own environment is given back
    assert report["gcs"].startswith(f"{LOOPBACK}:")
    assert report["joined"] == f"{MARK}42 {LOOPBACK}"  # another driver joins it by that address


def test_loopback_mode_is_scoped_and_an_explicit_node_ip_wins() -> None:
    from ray._private import ray_constants, services

    before = ray_constants.ENABLE_RAY_CLUSTER
    with loopback_node():
        assert services.resolve_ip_for_localhost(LOOPBACK) == LOOPBACK  # not rewritten to a routable IP
        assert services.get_node_ip_address() == LOOPBACK
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    assert wants_loopback({}) and wants_loopback({NODE_IP_OPTION: "127.0.0.1"})
    assert not wants_loopback({NODE_IP_OPTION: "10.1.2.3"})  # an operator's explicit choice
    assert all(map(is_loopback, ["localhost", "127.0.0.2", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.1.2.3", "::ffff:10.1.2.3", "ray-head"]))
    assert joins_loopback("127.0.0.1:6379") and joins_loopback("[::1]:6379") and joins_loopback("localhost:6379")
    assert not any(map(joins_loopback, ["10.1.2.3:6379", "ray://127.0.0.1:10001", "auto", "head:6379"]))
