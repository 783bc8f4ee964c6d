"""Fixtures shared by the core tests: a real (local) Ray, one torch thread, real photos."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator

import numpy as np
import pytest


@pytest.fixture(scope="session")
def ray_for_the_session() -> Iterator[None]:
    """Shuts down at the end the Ray the core tests kept running: starting one per module cost ~5 s
    each (36 modules), and a worker's imports as much again."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest, ray_for_the_session: None):
    """A one-CPU local Ray for the requesting module; reuses one another test left running, and
    leaves it running for the next module (a module that needs another Ray shuts it down itself).
    The module is pickled by value: Ray workers cannot import test modules."""
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(request.module)
    if not ray.is_initialized():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


def jpeg(array: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two intra-op threads on a shared 2-core machine are 7-15x slower than one. Requested by
    the modules running a model (`pytestmark`), so other core tests never import torch."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """Three real photos (scikit-image's astronaut, coffee, cat) as JPEG q90."""
    import skimage

    return [jpeg(skimage.data.astronaut()), jpeg(skimage.data.coffee()), jpeg(skimage.data.chelsea())]

