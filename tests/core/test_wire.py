"""Stage arguments and reports cross a Ray job's Pipes messages as JSON (prx_core.compute.wire)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.compute.unit_results import UnitResults
from prx_core.models.caption_base import CaptionerConfig
from prx_core.shards.publish import StreamReport
from prx_core.shards.verify import VerifyReport
from prx_core.sources.catalog import SourceSpec
from prx_core.stages import entry
from prx_core.stages.entry import IngestReport, Progress, PublishReport, StreamCount
from prx_core.stages.mds_shards import MdsReport
from prx_core.stages.sample_keys import KeyResolution
from prx_core.stages.samples import SamplesReport
from prx_core.store.maintenance import FragmentHealth
from prx_core.store.storage import Storage

UNITS = UnitResults(summaries=[{"rows": 3, "node": "n1", "reasons": {"truncated": 1}}], ran=1, skipped=0, seconds=0.5)


def roundtrip(value: object) -> object:
    return wire.decode(json.loads(json.dumps(wire.encode(value))))


@pytest.mark.parametrize("value", [
    IngestReport(
        SamplesReport("web", rows=3, bytes=10, fragments_read=1, seconds=0.1, rejected=1, samples_version=2,
                      rejects_version=3, reasons={"truncated": 1}, units=UNITS),
        KeyResolution(rows=3, duplicate_rows=0, resolved=True, offenders=[{"sample_id": "a", "reason": "x"}]),
        FragmentHealth(fragments=1, rows=3, small_fragments=0, small_ratio=0.0, target_rows=10),
        [{"path": "a.jpg", "reason": "truncated"}]),
    PublishReport(
        MdsReport("web", written=2, streams=[StreamReport(1, 512, 512, "s3://b/x", 2, ["c0"], 1, 99)], rejects={},
                  seconds=1.0, read_versions={"buckets": 4}, units={"route": UNITS}),
        VerifyReport(streams=1, shards=1, samples=2, counts={"s3://b/x": 2}),
        [StreamCount("x", 2, None)], buckets_version=None),
    {"spec": SourceSpec("web", "folder", "/data/web"), "storage": Storage("s3://bucket/root", {"anon": False}),
     "config": CaptionerConfig(backend="source"), "progress": Progress("samples[web]", unit="chunks")},
    (1, "a", [2.5, None]),
    {"set": {"b", "a"}, "nested": [(1, 2)]},
])
def test_reports_and_arguments_roundtrip_equal(value: object) -> None:
    assert roundtrip(value) == value


def test_numpy_scalars_become_numbers() -> None:
    assert roundtrip({"n": np.int64(7), "f": np.float32(0.5)}) == {"n": 7, "f": 0.5}


@pytest.mark.parametrize("name", ["os:system", "builtins:dict", "prx_core.compute.wire:WireError",
                                  "prx_core_evil.mod:Thing", "prx_core.stages.entry:nothing_here"])
def test_only_prx_core_dataclasses_are_built(name: str) -> None:
    with pytest.raises(wire.WireError):
        wire.decode({wire.CLASS: name})


@pytest.mark.parametrize("value", [{1: "a"}, object(), b"bytes"])
def test_values_json_cannot_carry_are_refused(value: object) -> None:
    with pytest.raises(wire.WireError):
        wire.encode(value)


def test_run_stage_binds_progress_to_the_log(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    seen: dict[str, object] = {}

    def stage(progress: Throttle, rows: int) -> int:
        seen["progress"] = progress
        progress(1, 1, rows=rows, total_rows=rows)
        return rows

    monkeypatch.setitem(entry.STAGES, "toy", stage)
    assert entry.run_stage("toy", {"progress": Progress("toy[web]", unit="chunks"), "rows": 5}, lines.append) == 5
    assert isinstance(seen["progress"], Throttle)
    assert lines and lines[0].startswith("toy[web]: 1/1 chunks")


def test_unknown_stage_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown stage 'sample'.*samples"):
        entry.run_stage("sample", {}, print)
