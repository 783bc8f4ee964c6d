"""`prx-corpus build --stale`: what Dagster reports missing or unsynced, and why.

Dagster decides, not us: its `CachingStaleStatusResolver` is what the UI shows as "Unsynced" and
what `RunRequest(stale_assets_only=True)` filters with (dagster 1.13 has no public wrapper, so this
module is the one place that imports it). Per asset partition it reports: never materialized, a
new code version (a setting hashed into `code_version=` changed), or an upstream data version that
changed since. Dagster does not propagate a stale status downstream (an upstream's new code version
makes its children unsynced only once it is rematerialized), so everything that depends on a chosen
partition, within the selection, is chosen too ("upstream captions is rebuilt"): a `--stale` build
ends with nothing unsynced, and the next one has nothing to do.

Cost: a few event-log queries per asset partition (assets x sources), never a row of a table.
Dagster itself stops checking the data versions of an unpartitioned asset's partitioned inputs
(`duplicates` <- `phashes`) above 100 sources; a phashes partition rebuilt in the same plan still
brings `duplicates` in.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import dagster as dg
from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
from dagster._core.definitions.assets.graph.base_asset_graph import BaseAssetGraph
from dagster._core.definitions.data_version import (
    CachingStaleStatusResolver,
    StaleCause,
    StaleCauseCategory,
    StaleStatus,
    extract_data_provenance_from_entry,
)
from dagster._time import get_current_datetime

from prx_assets.settings import ALL_ASSETS


@dataclass(frozen=True)
class Choice:
    """One asset partition `--stale` materializes, and Dagster's reason for it."""

    asset: str
    partition: str | None  # None: the global `duplicates`
    reason: str

    def line(self) -> str:
        return f"{self.asset} [{self.partition or 'global'}]: {self.reason}"


def stale_choices(defs: dg.Definitions, instance: dg.DagsterInstance, partitions: list[str],
                  select: Collection[str] | None = None) -> list[Choice]:
    """The asset partitions of `partitions` x `select` (default: every asset) to materialize, in
    run_build's order: those Dagster reports missing or unsynced, and what depends on them."""
    graph = defs.resolve_asset_graph()
    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=instance, asset_graph=graph)
    resolver = CachingStaleStatusResolver(instance=instance, asset_graph=graph, loading_context=view)
    chosen: dict[tuple[str, str | None], Choice] = {}
    for asset in ALL_ASSETS:  # topological: each asset after everything it reads
        if select and asset not in select:
            continue
        key = dg.AssetKey(asset)
        for partition in partitions if graph.get(key).is_partitioned else [None]:
            reason = dagster_reason(resolver, graph, instance, key, partition) or upstream_reason(
                chosen, graph, key, partition)
            if reason:
                chosen[(asset, partition)] = Choice(asset, partition, reason)
    return sorted(chosen.values(), key=lambda c: run_order(c, partitions))


def run_order(choice: Choice, partitions: list[str]) -> tuple[int, int, int]:
    """run_build's order: each source's chain, then the global `duplicates`, then each source's
    `skip_lists` and `explorer` (which read the duplicates)."""
    where = partitions.index(choice.partition) if choice.partition in partitions else 0
    phase = 1 if choice.partition is None else 2 if choice.asset in ("skip_lists", "explorer") else 0
    return phase, where, ALL_ASSETS.index(choice.asset)


def dagster_reason(resolver: CachingStaleStatusResolver, graph: BaseAssetGraph, instance: dg.DagsterInstance,
                   key: dg.AssetKey, partition: str | None) -> str | None:
    """Dagster's own status of one asset partition in words; None when it is fresh."""
    status = resolver.get_status(key, partition)
    if status == StaleStatus.MISSING:
        return "never materialized"
    if status == StaleStatus.FRESH:
        return None
    words: list[str] = []
    changed: dict[str, list[str]] = {}  # upstream asset -> its changed partitions (other than this one)
    for cause in resolver.get_stale_causes(key, partition):
        if cause.category == StaleCauseCategory.CODE:
            recorded = recorded_code_version(instance, key, partition)
            words.append(f"code version {version_change(recorded, graph.get(key).code_version or '?')}")
        elif cause.category == StaleCauseCategory.DATA and cause.dependency is not None:
            other = cause.dependency_partition_key
            changed.setdefault(cause.dependency_asset_key.to_user_string(), []).extend(
                [other] if other and other != partition else [])
        else:
            words.append(cause_words(cause))
    for upstream, others in changed.items():
        where = f" [{', '.join(sorted(set(others)))}]" if others else ""
        words.append(f"upstream {upstream}{where} changed")
    return "; ".join(dict.fromkeys(words)) or "unsynced"


def upstream_reason(chosen: dict[tuple[str, str | None], Choice], graph: BaseAssetGraph, key: dg.AssetKey,
                    partition: str | None) -> str | None:
    """`upstream X is rebuilt` when this build rematerializes an input of this partition. The
    graph's partition mappings are identities between `sources` partitions, all of them into the
    global `duplicates`, and the global one into each source."""
    rebuilt = []
    for parent in sorted(graph.get(key).parent_keys, key=lambda k: k.to_user_string()):
        name = parent.to_user_string()
        if any(asset == name and (p == partition or p is None or partition is None) for asset, p in chosen):
            rebuilt.append(name)
    return f"upstream {', '.join(rebuilt)} {'is' if len(rebuilt) == 1 else 'are'} rebuilt" if rebuilt else None


def recorded_code_version(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str | None) -> str:
    """The code version the latest materialization of this partition was made with."""
    record = instance.get_latest_data_version_record(key, False, partition)
    provenance = extract_data_provenance_from_entry(record.event_log_entry) if record else None
    return provenance.code_version if provenance and provenance.code_version else "?"


def version_change(old: str, new: str) -> str:
    """`old -> new`, with each long `-` part the two share cut to 8 characters (`b8b031c9…-2171607da5afe231
    -> b8b031c9…-9b3ba1937b093821`): a code version joins the versions of the settings behind it."""
    before, after = old.split("-"), new.split("-")
    if len(before) == len(after):
        same = [a == b and len(a) > 16 for a, b in zip(before, after)]
        before = [f"{a[:8]}…" if cut else a for a, cut in zip(before, same)]
        after = [f"{a[:8]}…" if cut else a for a, cut in zip(after, same)]
    return f"{'-'.join(before)} -> {'-'.join(after)}"


def cause_words(cause: StaleCause) -> str:
    """Dagster's own wording of a dependency change (`has a new dependency on X`), subject-less."""
    return cause.reason.removeprefix("has a ").removeprefix("has ")


def choice_lines(choices: list[Choice]) -> list[str]:
    """What `--stale` prints before running: one line per chosen asset partition, or that there is none."""
    if not choices:
        return ["stale: nothing to materialize (Dagster reports every selected asset partition up to date)"]
    return [f"stale: {len(choices)} asset partitions to materialize"] + [f"  {c.line()}" for c in choices]


def stale_plan(defs: dg.Definitions, instance: dg.DagsterInstance, partitions: list[str],
               select: Collection[str] | None, echo: Callable[..., None] = print) -> set[tuple[str, str | None]]:
    """`build --stale`'s choice, printed: the (asset, partition) pairs run_build is to materialize (maybe none)."""
    choices = stale_choices(defs, instance, partitions, select)
    for line in choice_lines(choices):
        echo(line, flush=True)
    return {(c.asset, c.partition) for c in choices}
