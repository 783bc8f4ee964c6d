"""What every stage module shares: the source partitions and metadata helpers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import dagster as dg

from prx_core.compute.units import UnitResults
from prx_core.sources.catalog import NAME_PATTERN, Catalog, SourceSpec
from prx_core.store.locks import RUN_LABEL

SOURCES = dg.DynamicPartitionsDefinition(name="sources")
GROUP = "corpus"


def sync_partitions(instance: dg.DagsterInstance, catalog: Catalog) -> tuple[list[str], list[str]]:
    """Make the `sources` partitions equal to the catalog's names; returns (added, removed).

    Removing a partition forgets it in Dagster only: its rows stay in the tables until a
    source's data is deleted on purpose.
    """
    current = set(instance.get_dynamic_partitions(SOURCES.name))
    wanted = catalog.names
    added = [name for name in wanted if name not in current]
    removed = sorted(current - set(wanted))
    if added:
        instance.add_dynamic_partitions(SOURCES.name, added)
    for name in removed:
        instance.delete_dynamic_partition(SOURCES.name, name)
    return added, removed


def catalog_source(context: dg.AssetExecutionContext, catalog: Any) -> SourceSpec:
    """The catalog's source for this run's partition, checked before anything touches storage.

    Anyone who can reach the UI or the GraphQL API can add a `sources` partition (`..`, `evil`);
    a key that is not a catalog name fails the asset here, so it never becomes a path or a
    predicate. Also names this run in the partition lock the stage takes (`prx_core.store.locks`).
    """
    key, asset = context.partition_key, context.assets_def.key.to_user_string()
    names = catalog.load().names
    if not isinstance(key, str) or not NAME_PATTERN.fullmatch(key) or key not in names:
        raise dg.Failure(
            description=f"partition {key!r} of asset {asset!r} is not a source of the catalog {catalog.path} "
                        f"(known: {', '.join(names)}); nothing was read or written. Add the source to the catalog, "
                        "or delete the partition (the sources sensor keeps partitions equal to the catalog).",
            allow_retries=False)
    RUN_LABEL.set(f"dagster run {context.run.run_id}")
    return catalog.source(key)


def md_table(rows: Iterable[Mapping[str, Any]], columns: list[str] | None = None) -> dg.MetadataValue:
    """A small Markdown table for the UI (the asset's metadata panel renders it)."""
    rows = list(rows)
    columns = columns or (list(rows[0]) if rows else ["(none)"])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return dg.MetadataValue.md("\n".join(lines))


def counts_table(counts: Mapping[str, int], key: str, total: int | None = None) -> dg.MetadataValue:
    total = total if total is not None else sum(counts.values())
    rows = [{key: k, "count": v, "share": f"{v / max(total, 1):.1%}"} for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return md_table(rows, [key, "count", "share"])


def units_metadata(results: UnitResults | None) -> dict[str, Any]:
    """How a unit-based stage ran: units planned, run now, resumed from an earlier attempt."""
    if results is None:
        return {}
    return {"units": results.units, "units_run": results.ran, "units_resumed": results.skipped,
            "worker_peak_rss_mb": results.worker_peak_rss_mb(), "ray_nodes": len(results.nodes())}


def lance_versions(**versions: int | None) -> dict[str, Any]:
    """Metadata entries `lance_version/<table>` for the versions read or written."""
    return {f"lance_version/{table}": dg.MetadataValue.int(v) for table, v in versions.items() if v is not None}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ") if value is not None else ""
