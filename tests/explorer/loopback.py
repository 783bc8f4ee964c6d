"""An explorer app served by a real uvicorn on 127.0.0.1 inside the test process (so a test can
count what the app does), and plain HTTP requests to it."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


@contextmanager
def serve(app: Starlette, timeout: float = 60.0) -> Iterator[int]:
    """`app` on a free loopback port until the block ends; yields the port."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="explorer-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout)


def fetch(port: int, path: str, timeout: float = 120.0) -> Answer:
    """GET `path` from the loopback port, with its own connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path, headers={"Host": f"127.0.0.1:{port}"})
        response = connection.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()


def wait_for(condition, timeout: float = 60.0) -> None:
    """Poll `condition` until it holds; fail the test when it never does."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)
