"""Automation conditions: Dagster's `eager`, on new data rather than on any new materialization.

`AutomationCondition.eager()` requests an asset when any dependency was *materialized* since the
last tick. Every stage here gives its materialization a data version from content
(`prx_assets.versions`), and a rerun that changed nothing (`samples`' "unchanged: nothing to run",
a retried run, `prx-corpus build` over a built corpus) keeps it; eager still launched every
downstream eager asset 3 s later (buckets, caption_embeddings, explorer: 100 s of work for
nothing). `eager_on_new_data` is eager with `newly_updated` replaced by `data_version_changed`:
a dependency counts as updated only when its data version changed, as Dagster's own staleness
(the UI's "Unsynced") already judges it.
"""

from __future__ import annotations

import dagster as dg

AC = dg.AutomationCondition


def any_deps_changed(ignored: dg.AssetSelection | None = None,
                     after: dg.AssetSelection | None = None) -> dg.AutomationCondition:
    """A dependency (but those `ignored`) has a new data version since the previous tick (not
    written by a run that also runs this asset), or will be requested on this tick (but those
    `after`: this asset waits for their run and follows only when their data version changed)."""
    changed = AC.any_deps_match(
        (AC.data_version_changed() & ~AC.executed_with_root_target()).with_label("data_version_changed_without_root"))
    along = AC.any_deps_match(AC.will_be_requested())
    if ignored is not None:
        changed, along = changed.ignore(ignored), along.ignore(ignored)
    if after is not None:
        along = along.ignore(after)
    return (changed | along).with_label("any_deps_changed")


def eager_on_new_data(ignored: dg.AssetSelection | None = None,
                      after: dg.AssetSelection | None = None) -> dg.AutomationCondition:
    """`eager()`, on new data: missing, or a dependency's data changed (`ignored` ones aside, `after`
    ones once their run is done); never while a dependency is missing or in progress, or the asset
    itself is."""
    return (
        AC.in_latest_time_window()
        & (AC.newly_missing() | any_deps_changed(ignored, after)).since_last_handled()
        & ~AC.any_deps_missing()
        & ~AC.any_deps_in_progress()
        & ~AC.in_progress()
    ).with_label("eager_on_new_data")


# the cheap per-source assets: on new upstream data, or when a setting hashed into their code version changed
CHEAP = eager_on_new_data() | AC.code_version_changed()
# the explorer: the global `duplicates` moves with every source's run, which would rerun every source's
# explorer each time (O(sources^2) runs per backfill). It ignores it: this source's groups reach it through
# `skip_lists`, whose data version digests them (prx_assets.skip_lists), and which every `duplicates` run
# requests, so the explorer follows skip_lists only once its run showed a change, never along with it.
EXPLORER_CONDITION = eager_on_new_data(dg.AssetSelection.assets("duplicates"),
                                       dg.AssetSelection.assets("skip_lists")) | AC.code_version_changed()
