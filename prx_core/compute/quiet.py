"""Starting Ray without third-party noise that says nothing about the corpus (and hiding nothing else).

Every build printed three known lines an operator can do nothing about:

- Ray's "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt
  out", logged by every `ray.init` that starts a local Ray while RAY_AUTH_MODE is unset. Token
  authentication stays on (Ray's default); only that record of Ray's authentication logger is
  dropped, during `ray.init`. (Setting RAY_AUTH_MODE=token instead would also silence it, but Ray
  then skips generating the token of a fresh HOME and its GCS does not start.)
- Lance's "lance is not fork-safe" UserWarning, at every fork of a process that imported Lance. Ray
  starts its GCS, raylet and monitors with `subprocess` and a `preexec_fn` (a fork followed at once by
  exec: no Lance runs in the child), so the warning is ignored during `ray.init` only; any other fork
  still warns.
- The GCS's "Failed to kill actor ..., return status: ... KillActor RPC failed" ERROR line, forwarded
  to the driver when an actor's worker is already gone at shutdown. Benign: Ray removed the log
  upstream (ray-project/ray#58544). Only that GCS line is dropped; every other forwarded line prints.

`LANCE_LOG=error` (when unset) keeps Lance's Rust INFO lines ("No existing dataset, it will be
created") out of the output, as the CLI did before.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LANCE_FORK_WARNING = "lance is not fork-safe"
RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
GCS_KILL_LINE = "Failed to kill actor"
NOISE = (LANCE_FORK_WARNING, RAY_TOKEN_NOTICE, GCS_KILL_LINE)  # what a quiet build never prints
STARTUP_TIMEOUT = "timed out during startup"  # ray._private.node: its raylet missed a fixed 30 s
START_ATTEMPTS = 3


TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropMessages(logging.Filter):
    """Drops log records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def drop_benign_gcs_lines() -> None:
    """Drop the GCS's benign kill-actor line from the logs Ray forwards to this driver (idempotent).

    Wraps Ray's `print_to_stdstream` (ray._private.worker); when a Ray release renames it, nothing
    is wrapped and the line simply prints again."""
    from ray._private import worker

    original = getattr(worker, "print_to_stdstream", None)
    if original is None or getattr(original, "_prx_quiet", False):
        return

    def print_to_stdstream(data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if data.get("pid") == "gcs_server":
            data = {**data, "lines": [line for line in data.get("lines", []) if GCS_KILL_LINE not in line]}
            if not data["lines"]:
                return None
        return original(data, *args, **kwargs)

    print_to_stdstream._prx_quiet = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = print_to_stdstream


@contextmanager
def quiet_ray_start(local: bool) -> Iterator[None]:
    """Around the code that calls `ray.init` (ours, or dagster-ray's LocalRay): `local` when it
    starts a Ray in this process, False when it connects to a cluster."""
    os.environ.setdefault("LANCE_LOG", "error")  # never overriding an operator's value
    drop_benign_gcs_lines()
    token_logger, notice = logging.getLogger(TOKEN_LOGGER), _DropMessages(RAY_TOKEN_NOTICE)
    if local:
        token_logger.addFilter(notice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LANCE_FORK_WARNING, category=UserWarning)
            yield
    finally:
        token_logger.removeFilter(notice)


def start_ray(address: str | None = None, **options: Any) -> None:
    """`ray.init` for a driver: an embedded Ray (no `address`; no dashboard, warnings only, listening
    on loopback only: prx_core.compute.loopback) or a connection to `address` (a loopback one joined
    on loopback), without the noise above."""
    import ray

    from prx_core.compute.loopback import joins_loopback, loopback_node, wants_loopback

    defaults: dict[str, Any] = {"logging_level": "warning"}
    if not address:
        defaults.update(include_dashboard=False, configure_logging=False)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            loopback = joins_loopback(address) if address else wants_loopback(options)
            with quiet_ray_start(local=not address), loopback_node(loopback):
                ray.init(**({"address": address} if address else {}), **{**defaults, **options})
            return
        except Exception as exc:  # Ray raises a bare Exception when its raylet misses its fixed 30 s
            if address or attempt == START_ATTEMPTS or STARTUP_TIMEOUT not in str(exc):
                raise
            ray.shutdown()  # a loaded machine: the embedded Ray gets another start, not a failed build
            print(f"Ray's node did not start within its 30 s (attempt {attempt} of {START_ATTEMPTS}, the machine is "
                  "busy): starting it again", file=sys.stderr)
