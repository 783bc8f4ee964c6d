"""A GPU model actor waits through the CPU model stages between two sources (prx_core.compute.actors):
the next source's captioner run reuses its process and model. On a Ray of 2 CPUs declaring one
(logical) GPU, as a GPU node's Ray declares its GPUs; the models are test_actors' stand-ins."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import test_actors
from test_actors import Counted, on_actor

from prx_core.compute.actors import IDLE, imap_actors, release_idle
from prx_core.compute.quiet import start_ray


@pytest.fixture(scope="module")
def gpu_ray() -> Iterator[None]:
    import ray

    if ray.is_initialized():  # another module's Ray has no GPU
        ray.shutdown()
    start_ray(num_cpus=2, num_gpus=1, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(test_actors)  # the stand-in models: workers cannot import tests
    yield
    release_idle()
    ray.shutdown()


def pids(factory, num_gpus: float) -> set[int]:
    return {pid for _, (pid, _) in imap_actors(factory, on_actor, [(1,), (2,)], num_gpus=num_gpus)}


def test_the_captioner_outlives_the_labeller_and_serves_the_next_source(gpu_ray: None, tmp_path: Path) -> None:
    captioner, labeller = partial(Counted, "captioner", str(tmp_path)), partial(Counted, "labeller", str(tmp_path))
    first = pids(captioner, num_gpus=1)  # source a: captions on the GPU,
    assert pids(labeller, num_gpus=0) != first  # labels on a CPU actor beside it (one CPU free: it fits),
    assert pids(captioner, num_gpus=1) == first  # source b: captions on the same actor, model not built again
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["captioner", "labeller"]
    assert len(IDLE) == 1  # at most half the CPUs idle: the captioner's
