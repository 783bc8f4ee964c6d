"""Fixtures shared by the core tests that need a real (local) Ray."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest):
    """A one-CPU local Ray for the requesting module; reuses one another test left running, and
    leaves it be. The module is pickled by value: Ray workers cannot import test modules."""
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(request.module)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    if started:
        ray.shutdown()
