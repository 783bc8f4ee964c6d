"""Dagster as deployed, on this machine: the instance of deploy/dagster.yaml on a throwaway
PostgreSQL (postgres_server.py), a code server serving prx_assets.definitions (`dagster api grpc`,
as the Helm chart's user-code deployment), `dagster-daemon run` and `dagster-webserver`, each a
real process in its own session. The test talks to it as a user does (GraphQL over HTTP) and
reads the instance (PostgreSQL) to see what the daemon did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
import pytest
import yaml
from dagster_graphql import DagsterGraphQLClient
from postgres_server import PostgresServer, free_port
from test_build import cli_env

REPO = Path(__file__).resolve().parents[2]
DEPLOYED = REPO / "deploy" / "dagster.yaml"
BIN = Path(sys.executable).parent
LOCATION, REPOSITORY = "prx_corpus", "__repository__"
T = TypeVar("T")


def instance_config(pg: PostgresServer) -> dict[str, Any]:
    """deploy/dagster.yaml with only what cannot run here replaced: the K8sRunLauncher (no
    Kubernetes) by the DefaultRunLauncher, the port by the test server's, `sslmode: require` dropped
    (a loopback server without TLS); and one interval: run monitoring polls every 5 s, not 120, so
    that the test sees it act within seconds. Storage, queue, pools, retries stay as shipped."""
    config = yaml.safe_load(DEPLOYED.read_text())
    config["run_monitoring"]["poll_interval_seconds"] = 5
    assert config.pop("run_launcher")["class"] == "K8sRunLauncher"
    database = config["storage"]["postgres"]["postgres_db"]
    database["port"] = pg.port
    assert database.pop("params") == {"sslmode": "require"}
    return config


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log: Path

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return f"--- {self.name} ({'running' if self.proc.poll() is None else f'exit {self.proc.returncode}'}) ---\n" \
               + "\n".join(text[-lines:])

    def stop(self) -> None:
        """The whole session: run workers, their step processes and their Ray go with the code server."""
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the session
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


class Deployment:
    def __init__(self, home: Path, pg: PostgresServer, env: dict[str, str], webserver_port: int) -> None:
        self.home, self.pg, self.env, self.webserver_port = home, pg, env, webserver_port
        self.services: list[Service] = []
        self.instance = dg.DagsterInstance.from_config(str(home))
        self.client = DagsterGraphQLClient("127.0.0.1", port_number=webserver_port, timeout=120)

    def start(self, name: str, args: list[str]) -> Service:
        log = self.home / f"{name}.log"
        proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=self.env, cwd=self.home,
                                start_new_session=True)
        self.services.append(Service(name, proc, log))
        return self.services[-1]

    def logs(self, lines: int = 40) -> str:
        return "\n".join(s.tail(lines) for s in self.services) + f"\n--- postgres ---\n{self.pg.log_tail(10)}"

    def wait_for(self, what: str, probe: Callable[[], T | None], timeout: float) -> T:
        """Poll `probe` until it returns something truthy; fail naming `what`, with every log's tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := probe():
                return value
            for service in self.services:
                if service.proc.poll() is not None:
                    pytest.fail(f"{service.name} exited while waiting for {what}\n{self.logs()}")
            time.sleep(1)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.webserver_port}/graphql",
                                         data=json.dumps({"query": query, "variables": variables}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            body = json.load(response)
        assert "errors" not in body, body
        return body["data"]

    def submit(self, assets: list[str], partition: str, **tags: str) -> str:
        """Submit a run of refresh_source to the queue, as the UI's Materialize button does."""
        return self.client.submit_job_execution("refresh_source", repository_location_name=LOCATION,
                                                repository_name=REPOSITORY, asset_selection=assets,
                                                tags={"dagster/partition": partition, **tags})

    def run(self, run_id: str) -> dg.DagsterRun:
        return self.instance.get_run_by_id(run_id)

    def wait_for_runs(self, run_ids: list[str], timeout: float) -> list[dg.DagsterRun]:
        done = self.wait_for(f"runs {run_ids} to finish", lambda: all(self.run(r).is_finished for r in run_ids), timeout)
        assert done
        return [self.run(r) for r in run_ids]


@contextmanager
def deployment(pg: PostgresServer, folder: Path, prx_env: dict[str, str]) -> Iterator[Deployment]:
    """Write $DAGSTER_HOME (the derived dagster.yaml, a workspace.yaml naming the code server),
    start code server, daemon and webserver; stop them all on exit."""
    home = folder / "dagster_home"
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text(yaml.safe_dump(instance_config(pg), sort_keys=False))
    grpc_port, web_port = free_port(), free_port()
    (home / "workspace.yaml").write_text(yaml.safe_dump({"load_from": [{"grpc_server": {
        "host": "127.0.0.1", "port": grpc_port, "location_name": LOCATION}}]}))
    env = cli_env(DAGSTER_HOME=str(home), **pg.dagster_env, **prx_env)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in pg.dagster_env.items():  # this process reads the same instance
            patch.setenv(name, value)
        deployed = Deployment(home, pg, env, web_port)
        try:
            deployed.start("code-server", [str(BIN / "dagster"), "api", "grpc", "-m", "prx_assets.definitions",
                                           "-d", str(REPO), "-h", "127.0.0.1", "-p", str(grpc_port),
                                           "--location-name", LOCATION])
            deployed.wait_for("the code server to answer", lambda: _code_server_up(grpc_port), 180)
            deployed.start("daemon", [str(BIN / "dagster-daemon"), "run", "-w", str(home / "workspace.yaml")])
            deployed.start("webserver", [str(BIN / "dagster-webserver"), "-w", str(home / "workspace.yaml"),
                                         "-h", "127.0.0.1", "-p", str(web_port)])
            deployed.wait_for("the webserver to load the code location", lambda: _location_loaded(deployed), 180)
            yield deployed
        finally:
            for service in reversed(deployed.services):
                service.stop()
            deployed.instance.dispose()


def _location_loaded(deployed: Deployment) -> bool:
    try:
        data = deployed.graphql("{ workspaceOrError { ... on Workspace { locationEntries { name "
                                "locationOrLoadError { __typename } } } } }")
    except OSError:
        return False
    entries = data["workspaceOrError"]["locationEntries"]
    return any(e["name"] == LOCATION and (e["locationOrLoadError"] or {}).get("__typename") == "RepositoryLocation"
               for e in entries)


def _code_server_up(port: int) -> bool:
    from dagster._grpc.client import DagsterGrpcClient

    try:
        DagsterGrpcClient(port=port, host="127.0.0.1").ping("")
        return True
    except Exception:  # not listening yet
        return False
