"""A TCP proxy in front of the loopback S3 endpoint that a test can take down and bring back (the
endpoint "restarts" with its objects kept, as a real one does), and that calls the test back when
a request it watches for goes through, so a fault happens at a chosen request of a stage."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable

REQUEST = re.compile(rb"(?:^|\r\n)(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.[01]\r\n")
Hook = Callable[["Proxy", str, str, socket.socket], bool]  # (proxy, method, path, client) -> drop this request


class Proxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.hooks, self.live = target, [], set()
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.port = 0
        self.resume()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def watch(self, method: str, pattern: str, hook: Hook, times: int = 1) -> None:
        """Call `hook` for the first `times` requests `method` whose path matches `pattern`."""
        self.hooks.append([method, re.compile(pattern), hook, times])

    def resume(self) -> None:
        """(Re)start accepting on the same port."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port, self.listener = listener.getsockname()[1], listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        """The endpoint goes down: new connections are refused, open ones are cut."""
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()
        with self.lock:
            live, self.live = list(self.live), set()
        for sock in live:
            _cut(sock)

    def down_for(self, seconds: float) -> None:
        self.stop()
        threading.Timer(seconds, self.resume).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _cut(client)
                continue
            with self.lock:
                self.live |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if from_client and self.hooks and self._dropped(data, src):
                    break
                dst.sendall(data)
        except Exception:  # a cut connection, or a failing hook: the request is lost, never hangs
            pass
        _cut(src)
        _cut(dst)

    def _dropped(self, data: bytes, client: socket.socket) -> bool:
        for match in REQUEST.finditer(data):
            method, path = match[1].decode(), match[2].decode()
            for hook in self.hooks:
                if hook[3] > 0 and hook[0] == method and hook[1].search(path):
                    hook[3] -= 1
                    if hook[2](self, method, path, client):
                        return True
        return False


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def client_pid(client: socket.socket, timeout: float = 10) -> int:
    """The process at the other end of a loopback connection the proxy accepted (a Ray worker):
    the socket inode bound to its port (/proc/net/tcp), then the process holding that inode."""
    import os

    port, proxy_port = client.getpeername()[1], client.getsockname()[1]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as table:
            inodes = {line.split()[9] for line in list(table)[1:]  # local port ours, remote the proxy's
                      if (int(line.split()[1].split(":")[1], 16), int(line.split()[2].split(":")[1], 16)) == (port, proxy_port)}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes} for fd in fds):
                    return int(pid)
            except OSError:
                continue
        time.sleep(0.1)
    raise LookupError(f"no process holds 127.0.0.1:{port}")
