"""The coverage checks' offenders: `captions` and `caption_labels` report each content still
without a caption or a label as the sample that owns it (its first bucketed sample in the
source) with the failure's reason, so the check's metadata names samples, not hashes."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from test_model_stages import CONFIG, storage  # noqa: F401  (the fixture: sources a and b, c7 uncaptioned)

from prx_core.compute.units import ModelSpec
from prx_core.models.label_base import LabelerConfig
from prx_core.models.labels import LabelBatch
from prx_core.stages.captions.stage import build_captions
from prx_core.stages.labels import build_labels
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")


class FailingOn(LabelBatch):
    """The real labeller, but a labeller error for the captions containing `word` (as the llm backend gives)."""

    def __init__(self, config: LabelerConfig, word: str) -> None:
        super().__init__(config)
        self.word = word

    def __call__(self, batch):  # type: ignore[override]
        out = super().__call__(batch)
        out["error"] = np.array(["http_error: 500" if self.word in str(c) else "" for c in batch["caption"]], object)
        return out


def test_captions_examples_name_the_owning_sample(storage: Storage) -> None:  # noqa: F811
    """c7 has no source caption: not a captioner failure (no offender), but listed by its sample."""
    report = build_captions("a", storage, CONFIG, unit_rows=3)
    assert report.missing == 1 and report.captioner_missing == 0 and report.offenders == []
    assert report.without_source_caption_examples == ["a/k07"]


def test_labels_offenders_name_the_owning_sample_and_the_error(storage: Storage) -> None:  # noqa: F811
    build_captions("a", storage, CONFIG)
    config = LabelerConfig()
    report = build_labels("a", storage, CONFIG.version(), config, unit_rows=4,
                          model=ModelSpec(partial(FailingOn, config, "first c3")))  # c3's at k03 (k10's: "second c3")
    assert report.failed == 1 and report.failures == {"http_error": 1}
    # the labels are keyed by caption key (content and source caption): the offender names its content and sample
    assert report.offenders == [{"sample_id": "a/k03", "content_id": "c3", "reason": "http_error"}]
    assert sum(report.distribution.values()) == report.captioned - 1  # the coverage check's failed count
