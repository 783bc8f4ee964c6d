"""What `build --stale` chooses and why (prx_cli.stale), on stand-ins of the corpus graph: the
same asset names, dependencies and partitioning, with a real Dagster instance and data versions
given by the test, so each cause (never materialized, code version, upstream data version, an
upstream rebuilt in the same plan) is set up exactly. No Ray, a few seconds."""

from __future__ import annotations

import dagster as dg

from prx_cli.stale import Choice, choice_lines, stale_choices

PARTITIONS = dg.DynamicPartitionsDefinition(name="sources")
DEPS = {"raw_source": [], "samples": ["raw_source"], "buckets": ["samples"], "phashes": ["samples"],
        "captions": ["buckets"], "caption_labels": ["captions"], "caption_embeddings": ["captions"],
        "text_latents": ["captions"], "mds_shards": ["buckets", "captions", "text_latents"], "duplicates": ["phashes"],
        "skip_lists": ["caption_labels", "mds_shards", "duplicates"],
        "explorer": ["samples", "buckets", "phashes", "captions", "caption_labels", "mds_shards", "duplicates",
                     "skip_lists"]}
CAPTIONER_DRIVEN = ("captions", "caption_labels", "caption_embeddings", "text_latents", "mds_shards", "skip_lists",
                    "explorer")
AFTER_DUPLICATES = ("skip_lists", "explorer")


def stand_in(name: str, code_version: str, data: dict[str, str]) -> dg.AssetsDefinition:
    """An asset whose data version is `data[name]` (default: fixed), read when it runs."""

    @dg.asset(name=name, deps=DEPS[name], code_version=code_version,
              partitions_def=None if name == "duplicates" else PARTITIONS)
    def _asset() -> dg.MaterializeResult:
        return dg.MaterializeResult(data_version=dg.DataVersion(data.get(name, "same")))

    return _asset


def graph(captioner: str, data: dict[str, str]) -> dg.Definitions:
    return dg.Definitions(assets=[stand_in(n, captioner if n in CAPTIONER_DRIVEN else "1", data) for n in DEPS])


def build_all(defs: dg.Definitions, instance: dg.DagsterInstance, partitions: list[str]) -> None:
    """What run_build does: each source's chain, then duplicates, then each source's skip_lists and explorer."""
    assets = list(defs.assets)
    chain = [n for n in DEPS if n != "duplicates" and n not in AFTER_DUPLICATES]
    for partition in partitions:
        assert dg.materialize(assets, selection=chain, partition_key=partition, instance=instance).success
    assert dg.materialize(assets, selection=["duplicates"], instance=instance).success
    for partition in partitions:
        assert dg.materialize(assets, selection=list(AFTER_DUPLICATES), partition_key=partition, instance=instance).success


def pairs(choices: list[Choice]) -> list[tuple[str, str | None]]:
    return [(c.asset, c.partition) for c in choices]


def test_each_cause_is_chosen_and_said_and_nothing_else() -> None:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("sources", ["a", "b"])
    data: dict[str, str] = {}
    defs = graph("cap3", data)
    fresh = stale_choices(defs, instance, ["a", "b"])
    assert all(c.reason == "never materialized" for c in fresh) and len(fresh) == 2 * 11 + 1
    assert pairs(fresh)[:9] == [(n, "a") for n in list(DEPS)[:9]]  # run order: a's chain first
    assert pairs(fresh)[18:] == [("duplicates", None), ("skip_lists", "a"), ("explorer", "a"), ("skip_lists", "b"),
                                 ("explorer", "b")]

    build_all(defs, instance, ["a", "b"])
    assert stale_choices(defs, instance, ["a", "b"]) == []
    assert choice_lines([]) == [
        "stale: nothing to materialize (Dagster reports every selected asset partition up to date)"]

    # a captioner setting changed: exactly what it drives, in both sources, with both versions
    changed = stale_choices(graph("cap4", data), instance, ["a", "b"])
    assert pairs(changed) == [(n, p) for p in "ab" for n in CAPTIONER_DRIVEN[:5]] + [
        (n, p) for p in "ab" for n in AFTER_DUPLICATES]
    assert {c.reason for c in changed} == {"code version cap3 -> cap4"}
    assert choice_lines(changed)[:2] == ["stale: 14 asset partitions to materialize",
                                         "  captions [a]: code version cap3 -> cap4"]
    assert pairs(stale_choices(graph("cap4", data), instance, ["b"], select=["captions", "skip_lists"])) == [
        ("captions", "b"), ("skip_lists", "b")]  # --source and --select narrow it

    # buckets [a] rematerialized with new data: Dagster reports its readers; the plan adds theirs
    data["buckets"] = "new"
    assert dg.materialize(list(defs.assets), selection=["buckets"], partition_key="a", instance=instance).success
    by_key = {(c.asset, c.partition): c.reason for c in stale_choices(defs, instance, ["a", "b"])}
    assert by_key == {("captions", "a"): "upstream buckets changed", ("mds_shards", "a"): "upstream buckets changed",
                      ("caption_labels", "a"): "upstream captions is rebuilt",
                      ("caption_embeddings", "a"): "upstream captions is rebuilt",
                      ("text_latents", "a"): "upstream captions is rebuilt",
                      ("skip_lists", "a"): "upstream caption_labels, mds_shards are rebuilt",
                      ("explorer", "a"): "upstream buckets changed"}


def test_a_new_source_brings_in_the_global_asset_and_every_sources_skip_lists_and_explorer() -> None:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("sources", ["a"])
    defs = graph("cap3", {})
    build_all(defs, instance, ["a"])
    instance.add_dynamic_partitions("sources", ["c"])
    by_key = {(c.asset, c.partition): c.reason for c in stale_choices(defs, instance, ["a", "c"])}
    assert by_key == {**{(n, "c"): "never materialized" for n in DEPS if n != "duplicates"},
                      ("duplicates", None): "upstream phashes is rebuilt",
                      ("skip_lists", "a"): "upstream duplicates is rebuilt",
                      ("explorer", "a"): "upstream duplicates, skip_lists are rebuilt"}
