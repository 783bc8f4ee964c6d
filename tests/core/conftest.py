"""Fixtures shared by the core tests: a real (local) Ray, one torch thread, real photos."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from jpegs import jpeg

if TYPE_CHECKING:
    from http_server import PhotoServer


# The tests mirror prx_core's packages (tests/core/<package>/test_*.py, a sub-package's in
# tests/core/<package>/<sub-package>/), and some modules share builders across them
# (`from test_row_stages import make_samples`): every package folder is on the path, so such an
# import works whichever folder pytest reached first (test_layout: no two test modules share a name).
sys.path[:0] = [str(folder) for folder in sorted(Path(__file__).parent.rglob("*"))
                if folder.is_dir() and not any(part.startswith(("_", "."))
                                               for part in folder.relative_to(Path(__file__).parent).parts)]

RAY_MODULES = pytest.StashKey[set[str]]()  # the core modules whose tests ask for `ray_cluster`, by file


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The core modules that use `ray_cluster` run last, one after another, so one Ray serves them
    all (starting one per module cost ~5 s each, 36 modules, and every worker's imports again); the
    others run first, in a process without Ray. Order within a module, and of other folders' tests,
    is kept."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in item.path.parents]
    core = [items[i] for i in slots]
    with_ray = config.stash[RAY_MODULES] = {str(item.path) for item in core
                                            if "ray_cluster" in getattr(item, "fixturenames", ())}
    ordered = sorted(core, key=lambda item: str(item.path) in with_ray)  # stable: file order kept
    for slot, item in zip(slots, ordered):
        items[slot] = item


@pytest.fixture(autouse=True, scope="module")
def _ray_only_where_asked(request: pytest.FixtureRequest) -> None:
    """A module that does not ask for `ray_cluster` runs without the Ray earlier modules kept: a
    `fork` beside Ray's threads can deadlock the child on a lock one of them held (test_manifest's
    publishers hung so once), and some modules want no Ray or one of their own."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and str(request.path) not in request.config.stash.get(RAY_MODULES, set()):
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_for_the_session() -> Iterator[None]:
    """Shuts down at the end the Ray the core tests kept running."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest, ray_for_the_session: None):
    """A one-CPU local Ray for the requesting module; reuses one another test left running, and
    leaves it running for the next module that asks for it (they run one after another).
    The module is pickled by value: Ray workers cannot import test modules."""
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(request.module)
    if not ray.is_initialized():
        from prx_core.compute.quiet import start_ray

        start_ray(num_cpus=1, log_to_driver=False)  # as the product starts one: on loopback only
    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


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
def served_photos() -> dict[str, bytes]:
    """The photos the loopback photo server serves, by name (http_server.load_photos)."""
    from http_server import load_photos

    return load_photos()


@pytest.fixture(scope="module")
def photo_server(served_photos: dict[str, bytes]) -> Iterator[PhotoServer]:
    """A loopback HTTP server of `served_photos` and of every failure a web host gives (http_server)."""
    from http_server import serving

    with serving(served_photos) as running:
        yield running


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """Three real photos (scikit-image's astronaut, coffee, cat) as JPEG q90."""
    import skimage

    return [jpeg(skimage.data.astronaut()), jpeg(skimage.data.coffee()), jpeg(skimage.data.chelsea())]

