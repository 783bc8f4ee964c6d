"""What `prx-corpus plan` sizes the wall time for, and what it prices a backfill at.

By default the machine the plan runs on (its usable cores, its GPUs as `nvidia-smi -L` lists them,
within CUDA_VISIBLE_DEVICES), or the Ray cluster the settings point at (`ray: {address: ...}`: its
CPUs and GPUs as the cluster reports them); `--cpus` / `--gpus` override either. The plan says
which. Prices are optional: per GPU-hour, per core-hour and per GB-month stored (any currency,
printed as given), so a backfill's cost is its GPU- and core-hours once, then its storage per month.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    cpus: int
    gpus: int
    what: str  # "this machine (host)", "the Ray cluster at ...", "given (--cpus, --gpus)"

    def describe(self) -> str:
        return f"{self.what}: {self.cpus} cores, {self.gpus} GPUs"


@dataclass(frozen=True)
class Prices:
    gpu_hour: float = 0.0
    cpu_hour: float = 0.0  # per core-hour
    gb_month: float = 0.0  # per GB (1e9 bytes) stored for a month
    currency: str = "$"

    def given(self) -> bool:
        return bool(self.gpu_hour or self.cpu_hour or self.gb_month)

    def cost(self, gpu_hours: float, core_hours: float, stored_bytes: float) -> dict[str, float]:
        """The backfill's compute cost (once) and its storage cost per month."""
        gpu, cpu = gpu_hours * self.gpu_hour, core_hours * self.cpu_hour
        return {"gpu": gpu, "cpu": cpu, "compute": gpu + cpu, "storage_per_month": stored_bytes / 1e9 * self.gb_month}


def this_machine() -> Machine:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Machine(cores, local_gpus(), f"this machine ({socket.gethostname()})")


def local_gpus() -> int:
    """NVIDIA GPUs this process may use: `nvidia-smi -L`, within CUDA_VISIBLE_DEVICES; 0 without a driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    listed = 0
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
            listed = sum(line.startswith("GPU ") for line in out.splitlines())
        except (OSError, subprocess.SubprocessError):
            listed = 0
    if visible is not None:
        wanted = [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]
        return min(listed, len(wanted))
    return listed


def ray_cluster(address: str) -> Machine:
    """The CPUs and GPUs a Ray cluster reports (one connection as a driver, then disconnected)."""
    import ray

    from prx_core.compute.quiet import start_ray

    started = not ray.is_initialized()
    if started:
        start_ray(address)
    try:
        resources = ray.cluster_resources()
    finally:
        if started:
            ray.shutdown()
    return Machine(int(resources.get("CPU", 0)), int(resources.get("GPU", 0)), f"the Ray cluster at {address}")


def choose(cpus: int | None, gpus: int | None, address: str | None) -> Machine:
    """The given counts, else what the cluster (`address`) or this machine has; says which."""
    if cpus is not None and gpus is not None:
        return Machine(cpus, gpus, "given (--cpus, --gpus)")
    found = ray_cluster(address) if address else this_machine()
    what = found.what if cpus is None and gpus is None else f"{found.what}, with --{'cpus' if cpus is not None else 'gpus'}"
    return Machine(found.cpus if cpus is None else cpus, found.gpus if gpus is None else gpus, what)
