"""What `prx-corpus plan` sizes for and what it prices (issue 43): this machine by default (its
usable cores, the GPUs `nvidia-smi -L` lists within CUDA_VISIBLE_DEVICES), given counts, and the
cost of a backfill from GPU-hour, core-hour and GB-month prices. The Ray cluster's own counts are
tests/e2e/test_plain_cluster.py's."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from prx_core.stages.plan.estimates import CorpusPlan, Models, estimate, format_plan
from prx_core.stages.plan.machine import Machine, Prices, choose, local_gpus, this_machine
from prx_core.stages.plan.sample import Bucketed, SampleStats, SourceSize


def fake_smi(folder: Path, gpus: int) -> None:
    """An `nvidia-smi` on PATH that lists `gpus` GPUs as the real one does."""
    script = folder / "nvidia-smi"
    lines = "\n".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})'" for i in range(gpus))
    script.write_text(f"#!/bin/sh\n{lines}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_this_machine_and_given_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake_smi(tmp_path, 4)
    here = this_machine()
    assert here.cpus == len(os.sched_getaffinity(0)) and here.gpus == 4 and here.what.startswith("this machine (")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert local_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpus() == 0
    (tmp_path / "nvidia-smi").unlink()  # no driver: no GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert local_gpus() == 0
    assert choose(64, 8, None) == Machine(64, 8, "given (--cpus, --gpus)")
    mixed = choose(None, 2, None)
    assert (mixed.cpus, mixed.gpus) == (here.cpus, 2) and mixed.describe().endswith(f", with --gpus: {here.cpus} cores, 2 GPUs")


def vlm_plan(machine: Machine, prices: Prices | None) -> CorpusPlan:
    stats = SampleStats(read=2, record_bytes=120_000, decoded=2, inspect_s=0.01, render_s=0.02,
                        bucketed=[Bucketed("512/640x480", True, 50_000, 40, "c1"), Bucketed("512/640x480", True, 50_000, 40, "c2")])
    plan = estimate("s", "parquet", stats, SourceSize(1, 0, 7_200_000, "parquet footers"), Models(vlm_captions=True))
    return CorpusPlan([plan], machine.cpus, machine.gpus, machine.describe(), prices)


def test_a_backfill_is_priced_and_a_gpu_less_machine_says_so() -> None:
    prices = Prices(gpu_hour=2.5, cpu_hour=0.04, gb_month=0.02)
    plan = vlm_plan(Machine(2, 0, "this machine (box)"), prices)
    totals = plan.totals()
    gpu_hours = 7_200_000 / 20 / 3600 * 1.05  # one caption per content at 20/s per GPU, 5% generated again
    assert totals["gpu_hours"] == pytest.approx(gpu_hours)
    assert totals["cost_gpu"] == pytest.approx(2.5 * gpu_hours)
    assert totals["cost_cpu"] == pytest.approx(0.04 * totals["core_hours"])
    assert totals["cost_storage_per_month"] == pytest.approx(totals["storage_bytes"] / 1e9 * 0.02)
    printed = format_plan(plan)
    assert "wall time on this machine (box): 2 cores, 0 GPUs: none: no GPU there for its 105 GPU-hours" in printed
    assert f"cost at $2.5/GPU-hour, $0.04/core-hour, $0.02/GB-month: ${totals['cost_compute']:,.2f} to build" in printed
    assert plan.to_json()["prices"]["gpu_hour"] == 2.5 and plan.to_json()["machine"] == "this machine (box): 2 cores, 0 GPUs"
    free = vlm_plan(Machine(64, 8, "given (--cpus, --gpus)"), None)
    assert "cost_compute" not in free.totals() and "cost at" not in format_plan(free)
    assert "wall time on given (--cpus, --gpus): 64 cores, 8 GPUs: " in format_plan(free)
    assert "captioning:" not in format_plan(free)  # no vLLM captioner: no engine line
    sized = replace(free, engines="vLLM engines of M on H200 x 1: 571 requests at once")
    assert "\ncaptioning: vLLM engines of M on H200 x 1: 571 requests at once" in format_plan(sized)
    assert sized.to_json()["engines"] == sized.engines
