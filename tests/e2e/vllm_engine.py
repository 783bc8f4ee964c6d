"""The real vLLM engine for the e2e tests: the vLLM test environment's Python (.venv-vllm, what
`make test` installs), the tiny checkpoint, and a `vllm serve` on 127.0.0.1 started and stopped
by the test that asks for it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from prx_core.models.tiny_vlm import TINY_MAX_PIXELS
from prx_core.models.vllm_cpu import cpu_runtime_env, vllm_python

SERVED_NAME = "tiny-qwen2-vl"


def engine_python() -> Path:
    python = vllm_python()
    assert python is not None, "no vLLM test environment: make test installs it (bash scripts/setup-vllm.sh)"
    return python


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class VLLMServer:
    """vLLM's OpenAI-compatible server (`vllm serve`) on 127.0.0.1 in its own process group, its log in `log`."""

    def __init__(self, python: Path, checkpoint: Path, log: Path, start_timeout: float = 480.0) -> None:
        self.port, self.log = free_port(), log
        env = {**os.environ, **cpu_runtime_env(python)["env_vars"]}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's engine core is its own child: the group is killed
        # what `vllm serve` runs; vllm-cpu's `vllm` console script looks up a distribution named "vllm" and exits
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", SERVED_NAME, "--max-model-len", "4096", "--enforce-eager", "--dtype", "float32",
                "--max-num-seqs", "16", "--limit-mm-per-prompt", json.dumps({"image": 1}),
                "--mm-processor-kwargs", json.dumps({"max_pixels": TINY_MAX_PIXELS})]
        self._out = open(log, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.wait_ready(start_timeout)
        self.start_seconds = time.monotonic() - self.started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"vllm serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        pytest.fail(f"vllm serve not ready within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the server's process group (API server, engine core), SIGKILL after 60 s."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        self._out.close()
