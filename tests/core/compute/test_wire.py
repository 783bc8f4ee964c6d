"""Stage arguments and reports cross a Ray job's Pipes messages as JSON (prx_core.compute.wire):
only registered classes are built, nesting is bounded, and the run accepts exactly one report, of
the stage's type, signed with its per-run key."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.compute.unit_results import UnitResults
from prx_core.models.caption_base import CaptionerConfig
from prx_core.shards.mds.publish import StreamReport
from prx_core.shards.mds.verify import VerifyReport
from prx_core.sources.catalog import DownloadSettings, JoinSpec, SourceSpec
from prx_core.stages import entry
from prx_core.stages.entry import IngestReport, Progress, PublishReport, StreamCount
from prx_core.stages.mds_shards.report import MdsReport
from prx_core.stages.samples.repeated_ids import KeyResolution
from prx_core.stages.samples.stage import SamplesReport
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun
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
    {"spec": SourceSpec("web", "parquet", "/data/web", metadata_columns=("m",), download=DownloadSettings(retries=1),
                        joins=(JoinSpec("/data/j.parquet", "key", "parquet", metadata_columns=("a",)),)),
     "storage": Storage("s3://bucket/root", {"anon": False}),
     "config": CaptionerConfig(backend="source"), "progress": Progress("samples[web]", unit="chunks")},
    (1, "a", [2.5, None]),
    {"set": {"b", "a"}, "nested": [(1, 2)]},
])
def test_reports_and_arguments_roundtrip_equal(value: object) -> None:
    assert roundtrip(value) == value


def test_numpy_scalars_become_numbers() -> None:
    assert roundtrip({"n": np.int64(7), "f": np.float32(0.5)}) == {"n": 7, "f": 0.5}


@pytest.mark.parametrize("name", ["os:system", "builtins:dict", "prx_core.compute.wire:WireError",
                                  "prx_core_evil.mod:Thing", "prx_core.stages.entry:nothing_here",
                                  "prx_core.store.lance_io:lance.blob.Blob", "lance.blob:Blob",
                                  "prx_core.compute.units:ModelSpec", "prx_core.stages.entry:dataclasses.Field"])
def test_only_registered_classes_are_built(name: str) -> None:
    """`lance.blob.Blob` was reachable through `prx_core.store.lance_io`'s `import lance`."""
    with pytest.raises(wire.WireError, match="not a class registered for the wire"):
        wire.decode({wire.CLASS: name, "data": b"".hex()})


def test_an_unregistered_dataclass_is_refused_on_both_sides() -> None:
    from lance.blob import Blob

    @dataclasses.dataclass
    class Unlisted:
        n: int

    for value in (Unlisted(1), Blob(b"x"), {"nested": [Unlisted(2)]}):
        with pytest.raises(wire.WireError, match="not registered for the wire"):
            wire.encode(value)
    with pytest.raises(TypeError):
        wire.register(dict)  # type: ignore[arg-type]


def test_a_registered_class_refuses_fields_it_does_not_have() -> None:
    good = wire.encode(entry.StreamCount("x", 2, None))
    with pytest.raises(wire.WireError, match="has no field"):
        wire.decode({**good, "__class__": "os:system"})
    with pytest.raises(wire.WireError, match="cannot build"):
        wire.decode({wire.CLASS: good[wire.CLASS], "name": "x"})


@pytest.mark.parametrize("wrap", [lambda v: [v], lambda v: {"k": v}, lambda v: {wire.TUPLE: [v]},
                                  lambda v: {wire.SET: [v]} if not isinstance(v, (list, dict)) else [v]])
def test_nesting_is_bounded_with_a_wire_error(wrap: Any) -> None:
    deep: Any = 0
    for _ in range(900):
        deep = wrap(deep)
    with pytest.raises(wire.WireError, match="nested deeper than"):
        wire.decode(deep)
    shallow: Any = 0
    for _ in range(wire.MAX_DEPTH - 1):
        shallow = [shallow]
    assert wire.decode(shallow) == shallow


def test_encoding_refuses_a_deep_value_too() -> None:
    deep: Any = []
    for _ in range(900):
        deep = [deep]
    with pytest.raises(wire.WireError, match="nested deeper than"):
        wire.encode(deep)


# -- the registry holds exactly what stages carry -------------------------------------------------------

def dataclasses_in(hint: Any, found: dict[str, type]) -> None:
    """Every dataclass reachable from a type hint, through containers and fields."""
    for arg in typing.get_args(hint):
        dataclasses_in(arg, found)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and wire.wire_name(hint) not in found:
        found[wire.wire_name(hint)] = hint
        hints = typing.get_type_hints(hint)
        for f in dataclasses.fields(hint):
            dataclasses_in(hints[f.name], found)


def carried() -> dict[str, type]:
    """What `run_stage` can take or return: every stage's parameters and return, the build functions
    its `**build` keywords reach, and `Progress` (a stage's `progress` argument on the wire)."""
    from prx_core.stages import caption_embeddings, labels
    from prx_core.stages.captions.stage import build_captions
    from prx_core.stages.duplicates.stage import build_duplicates
    from prx_core.stages.mds_shards.stage import build_mds
    from prx_core.stages.samples.stage import build_samples

    found: dict[str, type] = {}
    for stage in entry.STAGES.values():  # a declared stage: its settings' types and its report
        for hint in [*stage.setting_types().values(), stage.report_type]:
            dataclasses_in(hint, found)
    functions = [build_samples, build_mds, build_duplicates]
    functions += [build_captions, labels.build_labels,  # typed wrappers: `model=` (a ModelSpec) in-process
                  caption_embeddings.build_caption_embeddings]
    for fn in functions:
        for hint in typing.get_type_hints(inspect.unwrap(fn)).values():
            dataclasses_in(hint, found)
    dataclasses_in(entry.Progress, found)
    return found


def test_every_dataclass_a_stage_carries_is_registered_and_nothing_else() -> None:
    from prx_core.compute.units import ModelSpec

    reachable = carried()
    never = {wire.wire_name(ModelSpec)}  # holds a factory function: in-process only
    assert never <= set(reachable)
    assert sorted(set(reachable) - never - set(wire.registered())) == []
    assert sorted(set(wire.registered()) - set(reachable)) == []  # no class registered "just in case"


def loaded_with(module: str) -> set[str]:
    """The prx_core.stages modules that importing `module` runs: its module-level imports of
    stages, transitively (a lazy import inside a function registers nothing at import time)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = ast.parse(Path(importlib.import_module(name).__file__).read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prx_core.stages"):
                # `from prx_core.stages.duplicates import stage` loads a module, `from ...stage import X` one too
                todo += [f"{node.module}.{a.name}" if importlib.util.find_spec(node.module).submodule_search_locations
                         and importlib.util.find_spec(f"{node.module}.{a.name}") else node.module
                         for a in node.names]
    return seen


def test_each_stage_module_registers_what_its_stage_carries() -> None:
    """A stage's report is decoded (a reused run's, `prx_core.stages.unchanged`) wherever its module
    was imported, entry or not: the module, with the stage modules it imports, registers every
    class its declared stages take and report."""
    from prx_core.compute.units import ModelSpec

    missing = {}
    for module in sorted(loaded_with("prx_core.stages.entry")):
        declared = [v for v in vars(importlib.import_module(module)).values()
                    if isinstance(v, Stage) and v.name in entry.STAGES]
        found: dict[str, type] = {}
        for stage in declared:
            for hint in [*stage.setting_types().values(), stage.report_type]:
                dataclasses_in(hint, found)
        listed = {wire.wire_name(c) for m in loaded_with(module)
                  for c in getattr(importlib.import_module(m), "WIRE_TYPES", ())}
        if gaps := sorted(set(found) - listed - {wire.wire_name(ModelSpec)}):
            missing[module] = gaps
    assert missing == {}


def example(hint: Any) -> Any:
    """A value of `hint` with every field filled (nested dataclasses, containers, optionals)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {"any": [1, "x", None]}
    if origin in (typing.Union, types.UnionType):
        return example(next(a for a in args if a is not type(None)))
    if origin is list:
        return [example(args[0])]
    if origin in (dict, Mapping) or hint is dict:
        return {"k": example(args[1]) if args else 1}
    if origin is tuple:
        return (example(args[0]),)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: example(hints[f.name]) for f in dataclasses.fields(hint) if f.init})
    return {bool: True, int: 3, float: 0.5, str: "s"}[hint]


@pytest.mark.parametrize("stage", sorted(entry.STAGES))
def test_every_stage_report_roundtrips_and_opens_signed(stage: str) -> None:
    report_type = entry.report_type(stage)
    report = example(report_type)
    assert roundtrip(report) == report
    message = json.loads(json.dumps(wire.sign_report("run-key", stage, report)))  # as the log line carries it
    assert wire.open_report([message], "run-key", stage, report_type) == report


# -- one report, signed with the run's key, of the stage's type -----------------------------------------

REPORT = PublishReport(MdsReport("web", 1, [], {}, 1.0, {}), VerifyReport(0, 0, 0, {}), [], None)


def signed(report: Any = REPORT, key: str = "run-key", stage: str = "mds_shards") -> dict[str, Any]:
    return json.loads(json.dumps(wire.sign_report(key, stage, report)))


def forged(payload: Any) -> dict[str, Any]:
    """What anything printing a Pipes-shaped line into the job's log can send: no key."""
    return {wire.REPORT: payload, wire.MAC: "0" * 64}


def test_a_forged_report_line_is_refused() -> None:
    fake = forged(wire.encode(PublishReport(MdsReport("web", 10**9, [], {}, 1.0, {}), VerifyReport(0, 0, 0, {}), [],
                                            None)))
    for messages in ([fake], [{wire.REPORT: fake[wire.REPORT]}], [signed(key="another-run")],
                     [signed(stage="skip_lists")]):
        with pytest.raises(wire.WireError, match="0 report"):
            wire.open_report(messages, "run-key", "mds_shards", PublishReport)
    # the genuine report wins whatever is printed after it, and the forgeries are counted
    messages = [signed(), fake, {"other": "message"}]
    assert wire.open_report(messages, "run-key", "mds_shards", PublishReport) == REPORT
    assert wire.unsigned_reports(messages, "run-key", "mds_shards") == 1


def test_exactly_one_report_of_the_stage_type() -> None:
    with pytest.raises(wire.WireError, match="2 report"):
        wire.open_report([signed(), signed()], "run-key", "mds_shards", PublishReport)
    with pytest.raises(wire.WireError, match="0 report"):
        wire.open_report([], "run-key", "mds_shards", PublishReport)
    with pytest.raises(wire.WireError, match="not a PublishReport"):
        wire.open_report([signed(entry.StreamCount("x", 1, None))], "run-key", "mds_shards", PublishReport)


def test_a_forged_line_nested_deep_is_refused_without_recursion_error() -> None:
    deep: Any = 0
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(wire.WireError, match="0 report"):
        wire.open_report([forged(deep)], "run-key", "mds_shards", PublishReport)


@pytest.mark.parametrize("value", [{1: "a"}, object(), b"bytes"])
def test_values_json_cannot_carry_are_refused(value: object) -> None:
    with pytest.raises(wire.WireError):
        wire.encode(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToySettings(Settings):
    rows: int


def test_run_stage_binds_progress_to_the_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lines: list[str] = []

    def work(run: StageRun) -> None:
        assert isinstance(run.progress, Throttle)
        run.progress(1, 1, rows=run.settings.rows, total_rows=run.settings.rows)

    toy = Stage("toy", reads=(), writes=(), code_version="1", report_type=int, settings=ToySettings,
                pin=lambda run: {}, work=work, commit=lambda run: {}, report=lambda run: run.settings.rows)
    monkeypatch.setitem(entry.STAGES, "toy", toy)
    kwargs = {"storage": Storage(str(tmp_path)), "source": "web", "progress": Progress("toy[web]", unit="chunks"),
              "rows": 5}
    assert entry.run_stage("toy", kwargs, lines.append) == 5
    assert lines and lines[0].startswith("toy[web]: 1/1 chunks")


def test_unknown_stage_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown stage 'sample'.*samples"):
        entry.run_stage("sample", {}, print)


# -- the Ray-job path end to end, with the job run in this process and a forger in its log -------------

class FakeJobClient:
    """dagster-ray's PipesRayJobClient as `RayCluster.submit_stage` uses it: `run` hands the extras
    to the real job entrypoint (`prx_core.stages.job.main`) and returns what its log carried, a
    forged report line printed by something else included."""

    forgeries: list[dict[str, Any]] = []
    seen_extras: dict[str, Any] = {}

    def __init__(self, **_: Any) -> None:
        pass

    def run(self, *, context: Any, submit_job_params: dict[str, Any], extras: dict[str, Any]) -> Any:
        import contextlib
        from types import SimpleNamespace

        import dagster_pipes

        from prx_core.stages import job

        messages: list[Any] = []
        pipes = SimpleNamespace(get_extra=extras.__getitem__, log=SimpleNamespace(info=lambda line: None),
                                report_custom_message=messages.append)
        patch = pytest.MonkeyPatch()
        patch.setattr(dagster_pipes, "open_dagster_pipes", lambda: contextlib.nullcontext(pipes))
        try:
            job.main()
        finally:
            patch.undo()
        FakeJobClient.seen_extras = extras
        messages += FakeJobClient.forgeries
        return SimpleNamespace(get_custom_messages=lambda: messages,
                               metadata={"Ray Job ID": SimpleNamespace(value="raysubmit_1")})


@pytest.fixture
def ray_job(monkeypatch: pytest.MonkeyPatch) -> Any:
    from types import SimpleNamespace

    import dagster_ray.core.pipes
    import ray

    from prx_core.stages import job
    from prx_resources.ray import RayCluster

    report = example(entry.report_type("buckets"))
    monkeypatch.setattr(dagster_ray.core.pipes, "PipesRayJobClient", FakeJobClient)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])
    monkeypatch.setattr(job, "run_stage", lambda stage, kwargs, log: report)
    warnings: list[str] = []
    context = SimpleNamespace(run=SimpleNamespace(run_id="r1"), log=SimpleNamespace(warning=warnings.append),
                              add_asset_metadata=lambda metadata: None)
    cluster = RayCluster(address="ray://127.0.0.1:10001", jobs_address="http://127.0.0.1:8265")
    FakeJobClient.forgeries = []
    return SimpleNamespace(cluster=cluster, context=context, report=report, warnings=warnings)


def test_a_ray_job_report_is_the_signed_one_and_a_forged_line_is_refused(ray_job: Any) -> None:
    kwargs = {"source": "web", "storage": Storage("/tmp/corpus"), "progress": Progress("buckets[web]")}
    forged_report = {**wire.encode(ray_job.report), "rows": 10**9}
    FakeJobClient.forgeries = [forged(forged_report)]
    assert ray_job.cluster.submit_stage(ray_job.context, "buckets", kwargs) == ray_job.report
    key = FakeJobClient.seen_extras["report_key"]
    assert len(key) == 64 and key not in json.dumps(FakeJobClient.seen_extras["kwargs"])
    assert any("refused 1 report line(s) not signed" in w for w in ray_job.warnings)
    ray_job.cluster.submit_stage(ray_job.context, "buckets", kwargs)
    assert FakeJobClient.seen_extras["report_key"] != key  # a key per job

    replay = {**signed(ray_job.report, key=key, stage="buckets"), wire.REPORT: forged_report}
    FakeJobClient.forgeries = [signed(ray_job.report, key=key, stage="buckets"), replay]  # an earlier job's key
    assert ray_job.cluster.submit_stage(ray_job.context, "buckets", kwargs) == ray_job.report
    assert "refused 2 report line(s)" in ray_job.warnings[-1]


def test_a_ray_job_report_of_another_type_fails_the_run(ray_job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import dagster as dg

    from prx_core.stages import job

    monkeypatch.setattr(job, "run_stage", lambda stage, kwargs, log: entry.StreamCount("x", 1, None))
    expected = "Ray job raysubmit_1: stage buckets: the report is a StreamCount, not a BucketsReport"
    with pytest.raises(dg.Failure, match=expected):
        ray_job.cluster.submit_stage(ray_job.context, "buckets", {"source": "web"})


def test_a_report_recorded_under_a_class_s_former_name_still_decodes() -> None:
    """`samples` reports recorded before IngestReport moved into its stage's module (entry.py held it)
    stand for a rerun (prx_core.stages.unchanged): re-ingesting every source for a rename would be absurd."""
    report = example(IngestReport)
    payload = json.loads(json.dumps(wire.encode(report)).replace(wire.wire_name(IngestReport),
                                                                 "prx_core.stages.entry:IngestReport"))
    assert wire.decode(payload) == report
    assert wire.wire_name(IngestReport) in json.dumps(wire.encode(wire.decode(payload)))  # written under the new one


# Every wire name registered before stages/, sources/ and shards/ grouped their module families into
# sub-packages (the `duplicates` stage's module became `duplicates/stage.py`, ...). Reports of the
# reusable stages (samples, skip_lists, explorer) are recorded under these names in every corpus
# built before (`<root>/_reports/<asset>/<partition>/latest.json`, prx_core.stages.unchanged).
WIRE_NAMES_BEFORE_PACKAGES = [
    "prx_core.compute.unit_results:UnitResults",
    "prx_core.models.caption_base:CaptionerConfig",
    "prx_core.models.embeddings:EmbedderConfig",
    "prx_core.models.label_base:LabelerConfig",
    "prx_core.models.text_latents:TextLatentsConfig",
    "prx_core.shards.publish:StreamReport",
    "prx_core.shards.verify:VerifyReport",
    "prx_core.sources.catalog:SourceSpec",
    "prx_core.sources.catalog_fields:DownloadSettings",
    "prx_core.sources.catalog_fields:JoinSpec",
    "prx_core.stages.buckets:BucketsReport",
    "prx_core.stages.caption_embeddings:CaptionEmbeddingsReport",
    "prx_core.stages.captions_report:CaptionsReport",
    "prx_core.stages.duplicates:DuplicatesReport",
    "prx_core.stages.duplicates:GroupsReport",
    "prx_core.stages.duplicates_check:KeeperCheck",
    "prx_core.stages.entry:IngestReport",
    "prx_core.stages.entry:Progress",
    "prx_core.stages.explorer:ExplorerReport",
    "prx_core.stages.labels:LabelsReport",
    "prx_core.stages.mds_report:MdsReport",
    "prx_core.stages.mds_report:PublishReport",
    "prx_core.stages.mds_report:StreamCount",
    "prx_core.stages.phashes:PhashesReport",
    "prx_core.stages.sample_keys:KeyResolution",
    "prx_core.stages.samples:IngestReport",
    "prx_core.stages.samples:SamplesReport",
    "prx_core.stages.skip_lists:SkipPolicy",
    "prx_core.stages.skip_lists:SkipReport",
    "prx_core.stages.skip_lists:StreamSkips",
    "prx_core.stages.text_latents:TextLatentsReport",
    "prx_core.store.maintenance:FragmentHealth",
    "prx_core.store.maintenance:IndexReport",
    "prx_core.store.maintenance:VectorIndexCoverage",
    "prx_core.store.storage:Storage",
]


@pytest.mark.parametrize("name", WIRE_NAMES_BEFORE_PACKAGES)
def test_a_wire_name_written_before_the_packages_still_decodes(name: str) -> None:
    """A module moved into a package keeps decoding its classes' former names (`register_moved_from`):
    an unchanged partition reuses its recorded report instead of re-ingesting the source."""
    carried()  # imports every stage module, which registers what it carries
    cls = wire.registered().get(name) or wire.moved().get(name)
    assert cls is not None, f"{name} no longer decodes"
    try:
        value = example(cls)
    except ValueError:  # a model's config refuses example's filler ("s" is no backend): the name resolved
        return
    payload = json.loads(json.dumps(wire.encode(value)))
    payload[wire.CLASS] = name
    assert wire.decode(payload) == value
