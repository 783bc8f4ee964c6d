"""Model actors build their model at first use (prx_core.compute.actors): a rerun with nothing
pending never loads it (a VLM or an LLM takes minutes to load on a GPU), and a model that cannot be
built fails the stage with its own error, not "the actor died"."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import pytest
from test_model_stages import CONFIG, storage  # noqa: F401  (the fixture: sources a and b)

from prx_core.compute.units import ModelSpec
from prx_core.models.label_base import LabelerConfig
from prx_core.models.labels import LabelBatch
from prx_core.stages.captions.stage import build_captions
from prx_core.stages.labels import build_labels
from prx_core.stages.unchanged import force_next_run
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")


class CountedLabels(LabelBatch):
    """The real labeller, leaving one file in `loads` per model built (actors are other processes)."""

    def __init__(self, config: LabelerConfig, loads: str) -> None:
        Path(loads, f"{os.getpid()}-{time.monotonic_ns()}").touch()
        super().__init__(config)


class Unloadable(LabelBatch):
    def __init__(self, config: LabelerConfig) -> None:
        raise FileNotFoundError("no weights under /models/labeller: run prx-corpus fetch-models first")


def test_a_rerun_with_nothing_pending_never_loads_the_model(storage: Storage, tmp_path: Path) -> None:  # noqa: F811
    build_captions("a", storage, CONFIG)
    config, loads = LabelerConfig(), tmp_path / "loads"
    loads.mkdir()
    model = ModelSpec(partial(CountedLabels, config, str(loads)), actors=2)
    first = build_labels("a", storage, CONFIG.version(), config, unit_rows=4, model=model)
    built = len(list(loads.iterdir()))
    assert first.labelled == first.captioned > 0 and 1 <= built <= 2  # at most one per actor, not one per unit
    same = build_labels("a", storage, CONFIG.version(), config, unit_rows=4, model=model)  # reused: no actor
    assert same.units.ran == 0 and len(list(loads.iterdir())) == built
    assert force_next_run(storage, "caption_labels", "a")  # forced: every unit runs, none pending
    again = build_labels("a", storage, CONFIG.version(), config, unit_rows=4, model=model)
    assert (again.labelled, again.reused) == (0, again.captioned)
    assert len(list(loads.iterdir())) == built  # the actors started, and none built its model


def test_a_model_that_cannot_load_fails_the_stage_naming_why(storage: Storage) -> None:  # noqa: F811
    build_captions("a", storage, CONFIG)
    config = LabelerConfig()
    with pytest.raises(Exception, match="FileNotFoundError: no weights under /models/labeller: run prx-corpus"):
        build_labels("a", storage, CONFIG.version(), config, unit_rows=4, model=ModelSpec(partial(Unloadable, config)))
