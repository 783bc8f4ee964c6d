"""A throwaway PostgreSQL server for a test session: Debian's binaries (scripts/setup.sh installs
`postgresql` with the test dependencies), a cluster in a fresh folder, TCP on a free loopback port
with password (SCRAM) authentication as production has, the socket in the same folder, one empty
database. Never the system's own cluster; everything is removed when the context exits.

initdb refuses to run as root: as root every server command runs as Debian's `postgres` user
(`runuser`), which owns the folder."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = ("PostgreSQL is not installed: `make setup` (scripts/setup.sh, as root, with PRX_SETUP_TEST=1, the "
                "default) installs Debian's `postgresql` package; or run `apt-get install postgresql`")


class PostgresUnavailable(RuntimeError):
    """The server cannot be started here; the message names the fix."""


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    password: str
    database: str
    folder: Path

    @property
    def dagster_env(self) -> dict[str, str]:
        """The DAGSTER_PG_* variables deploy/dagster.yaml reads."""
        return {"DAGSTER_PG_HOST": self.host, "DAGSTER_PG_PORT": str(self.port), "DAGSTER_PG_DB": self.database,
                "DAGSTER_PG_USERNAME": self.user, "DAGSTER_PG_PASSWORD": self.password}

    def log_tail(self, lines: int = 40) -> str:
        path = self.folder / "server.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def postgres_bin() -> Path:
    """The newest Debian PostgreSQL bin folder (/usr/lib/postgresql/<major>/bin)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if not found:
        raise PostgresUnavailable(INSTALL_HINT)
    return found[-1].parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _as_owner(args: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return args
    if not shutil.which("runuser"):
        raise PostgresUnavailable("running as root without `runuser` (util-linux): cannot start PostgreSQL as `postgres`")
    return ["runuser", "-u", "postgres", "--", *args]


def _run(args: list[str], what: str) -> None:
    done = subprocess.run(_as_owner(args), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise PostgresUnavailable(f"{what} failed ({done.returncode}): {' '.join(args)}\n{done.stdout}\n{done.stderr}")


@contextmanager
def postgres_server(database: str = "dagster", user: str = "prx") -> Iterator[PostgresServer]:
    """Start the server, create `database`, yield how to reach it; stop and remove it on exit."""
    bin_dir = postgres_bin()
    # Directly under /tmp: the `postgres` user must traverse every parent (the test sandbox is 0700).
    folder = Path(tempfile.mkdtemp(prefix="prx-pg-", dir="/tmp"))
    try:
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise PostgresUnavailable(f"running as root and there is no `postgres` user. {INSTALL_HINT}") from None
            os.chown(folder, owner.pw_uid, owner.pw_gid)
        password = secrets.token_urlsafe(16)
        pwfile = folder / "password"
        pwfile.write_text(password + "\n")
        if os.geteuid() == 0:
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        data, port = folder / "data", free_port()
        _run([str(bin_dir / "initdb"), "-D", str(data), "-U", user, f"--pwfile={pwfile}", "--auth-local=trust",
              "--auth-host=scram-sha-256", "--encoding=UTF8", "--no-sync"], "initdb")
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        _run([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"), "-o", options, "-w",
              "-t", "60", "start"], "pg_ctl start")
        try:
            _run([str(bin_dir / "createdb"), "-h", str(folder), "-p", str(port), "-U", user, database], "createdb")
            yield PostgresServer("127.0.0.1", port, user, password, database, folder)
        finally:
            _run([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], "pg_ctl stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
