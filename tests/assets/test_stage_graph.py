"""The asset graph and code versions are the stage declarations' (prx_core.stages.stage.Stage):
each stage's asset follows exactly the assets its stage names (`after`), its code version begins
with its stage's, and what a stage reads is made upstream of it, so `reads` cannot drift from the
graph either."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest
from materializing import make_settings

from prx_assets.definitions import build_definitions
from prx_core.stages.entry import STAGES
from prx_core.stages.stage import Stage

OUTSIDE = {"raw_source": "raw_source"}  # what no stage writes: the source itself, observed by its own asset


@pytest.fixture(scope="module")
def graph(demo_dir: Path, tmp_path_factory) -> dg.AssetGraph:
    defs = build_definitions(make_settings(tmp_path_factory.mktemp("graph") / "root", demo_dir / "sources.yaml"))
    return defs.resolve_asset_graph()


def declared_graph(stages: dict[str, Stage]) -> dict[str, set[str]]:
    """asset -> the assets it follows, as the stage declarations give it."""
    return {name: set(stage.after) for name, stage in stages.items()}


def upstream(graph: dict[str, set[str]], name: str) -> set[str]:
    """Every asset `name` follows, directly or through others."""
    seen: set[str] = set()
    todo = list(graph.get(name, ()))
    while todo:
        parent = todo.pop()
        if parent not in seen:
            seen.add(parent)
            todo += graph.get(parent, ())
    return seen


def unproduced_reads(stages: dict[str, Stage]) -> dict[str, list[str]]:
    """Per stage, what it reads that no asset upstream of it writes (empty when the declarations agree)."""
    graph = declared_graph(stages)
    makers: dict[str, set[str]] = {}
    for stage in stages.values():
        for written in stage.writes:
            makers.setdefault(written, set()).add(stage.name)
    for written, asset in OUTSIDE.items():
        makers.setdefault(written, set()).add(asset)
    gaps = {name: sorted(r for r in stage.reads if not makers.get(r, set()) & upstream(graph, name))
            for name, stage in stages.items()}
    return {name: missing for name, missing in gaps.items() if missing}


def test_every_stage_has_its_asset(graph: dg.AssetGraph) -> None:
    assets = {key.to_user_string() for key in graph.get_all_asset_keys()}
    assert set(STAGES) <= assets
    assert all(set(stage.after) <= assets for stage in STAGES.values())


def test_the_asset_graph_is_the_declared_one(graph: dg.AssetGraph) -> None:
    actual = {name: {k.to_user_string() for k in graph.get(dg.AssetKey(name)).parent_keys} for name in STAGES}
    assert actual == declared_graph(STAGES)


def test_each_asset_code_version_begins_with_its_stage_s(graph: dg.AssetGraph) -> None:
    versions = {name: graph.get(dg.AssetKey(name)).code_version for name in STAGES}
    wrong = {name: (version, STAGES[name].code_version) for name, version in versions.items()
             if version != STAGES[name].code_version and not version.startswith(f"{STAGES[name].code_version}-")}
    assert wrong == {}


def test_what_a_stage_reads_is_made_upstream_of_it() -> None:
    assert unproduced_reads(STAGES) == {}


def test_a_drifted_declaration_is_caught() -> None:
    """The check above fails where a stage reads what its asset does not follow (skip_lists reading the
    streams without following mds_shards: the drift issue 42 found)."""
    import dataclasses

    drifted = {**STAGES, "skip_lists": dataclasses.replace(STAGES["skip_lists"], after=("duplicates", "caption_labels"))}
    assert unproduced_reads(drifted) == {"skip_lists": ["mds"]}
