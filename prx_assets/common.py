"""What every stage module shares: the source partitions, the Dagster conventions every asset
follows (owners, true kinds, partitioned checks) and the metadata helpers.

Metadata layout of every materialization: the headline numbers at the top level (counts, and the
rates worth a plot as plain floats with stable keys, so the Plots tab charts them per source),
Dagster's own entries (`dagster/row_count`, `dagster/column_schema`, `dagster/uri`), the corpus
root (`prx/root`), and two JSON entries kept out of the plots: `ops` (how the run ran: units,
resumes, peak RSS, Ray nodes, commits, seconds) and `lance_versions` (its lineage).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import dagster as dg
import pyarrow as pa

from prx_assets.settings import UNSTORED
from prx_core.compute.units import UnitResults
from prx_core.shards.mds.encodings import latent_columns
from prx_core.shards.mds.streams import MDS_COLUMNS
from prx_core.sources.catalog import NAME_PATTERN, Catalog, CatalogError, SourceSpec
from prx_core.store.locks import RUN_LABEL
from prx_core.store.schemas import TABLES
from prx_core.store.storage import is_remote
from prx_resources.storage import DEFAULT_OWNERS

OWNERS = list(DEFAULT_OWNERS)  # until with_conventions applies `storage.owners`
SOURCES = dg.DynamicPartitionsDefinition(name="sources")
GROUP = "corpus"
MAX_KINDS = 3  # kind tags per asset
FORMAT_KINDS = {"parquet": "parquet", "imagefolder": "images", "webdataset": "webdataset", "lance": "lance",
                "huggingface": "huggingface"}


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
    link_build_report(context)
    return catalog.source(key)


def link_build_report(context: dg.AssetExecutionContext) -> None:
    """A run launched by `prx-corpus build` names the report the build saves (`prx/build_report`,
    prx_cli.build_report): the materialization links to it."""
    uri = context.run.tags.get("prx/build_report")
    if uri:
        output = context.assets_def.get_output_name_for_asset_key(context.asset_key)
        context.add_output_metadata({"prx/build_report": where_value(uri)}, output_name=output)


# -- definitions: checks, owners, kinds ---------------------------------------------------------------

def source_check(name: str, asset: str, description: str, blocking: bool = False) -> dg.AssetCheckSpec:
    """A check whose results land on the run's source partition (Dagster 1.13 partitioned checks),
    so one source's failure never hides behind another's pass."""
    with warnings.catch_warnings():  # "partitions_def on an AssetCheckSpec" is a preview: said once here
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.AssetCheckSpec(name, asset=asset, description=description, blocking=blocking,
                                 partitions_def=SOURCES)


def storage_kind(root: str) -> str:
    return "s3" if is_remote(root) else "filesystem"


def source_kinds(catalog: Any) -> set[str]:
    """raw_source's kinds: where the catalog's sources are and their formats (kinds are per asset),
    the formats only while the tags are at most MAX_KINDS. A catalog that cannot be read gives none here:
    the sources sensor and `doctor` name its error; the code location still loads."""
    try:
        specs = catalog.load().sources
    except (CatalogError, OSError):
        return set()
    places, formats = {storage_kind(s.uri) for s in specs}, {FORMAT_KINDS.get(s.format, s.format) for s in specs}
    # at most MAX_KINDS tags, or the Catalog's list cell has no room for the name: a mixed catalog shows
    # where its sources are, each partition's `format` metadata says which format
    return places | formats if len(places | formats) <= MAX_KINDS else places


def with_conventions(assets: Sequence[dg.AssetsDefinition], resources: Mapping[str, Any]) -> list[dg.AssetsDefinition]:
    """Owners from `storage.owners`; every asset stored under the root gets the root's kind (`s3` only
    on S3); raw_source gets its sources' locations and formats. Called by `build_assets`."""
    storage, catalog = resources["storage"], resources["catalog"]
    stored_kind = storage_kind(storage.root)
    raw_kinds = source_kinds(catalog)

    def apply(spec: dg.AssetSpec) -> dg.AssetSpec:
        name = spec.key.to_user_string()
        kinds = set(spec.kinds) | (raw_kinds if name == "raw_source" else set() if name in UNSTORED else {stored_kind})
        return spec.replace_attributes(owners=list(storage.owners), kinds=kinds)

    return [asset.map_asset_specs(apply) for asset in assets]


# -- metadata -----------------------------------------------------------------------------------------

def md_table(rows: Iterable[Mapping[str, Any]], columns: list[str] | None = None) -> dg.MetadataValue:
    """A small Markdown table for the UI; "(none)" rather than an empty table."""
    rows = list(rows)
    if not rows:
        return dg.MetadataValue.text("(none)")
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return dg.MetadataValue.md("\n".join(lines))


def counts_table(counts: Mapping[str, int], key: str, total: int | None = None) -> dg.MetadataValue:
    total = total if total is not None else sum(counts.values())
    rows = [{key: k, "count": v, "share": f"{v / max(total, 1):.1%}"} for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return md_table(rows, [key, "count", "share"])


def rate(part: float, whole: float) -> dg.MetadataValue:
    """A plottable share (a plain float, 0 when nothing was counted)."""
    return dg.MetadataValue.float(round(float(part) / whole, 6) if whole else 0.0)


def per_second(value: float) -> dg.MetadataValue:
    return dg.MetadataValue.float(round(float(value), 2))


def human_bytes(count: int) -> str:
    """1288490188 -> '1.2 GiB'."""
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(size) < 1024 or unit == "PiB":
            break
        size /= 1024
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"


def human_seconds(seconds: float) -> str:
    """3725.2 -> '1h 02m 05s'; under a minute, '4.2 s'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def size_metadata(count: int, key: str = "bytes") -> dict[str, Any]:
    """`bytes` (the raw number) next to `size` ("1.2 GiB")."""
    return {key: dg.MetadataValue.int(int(count)), "size": human_bytes(int(count))}


def units_ops(results: UnitResults | None) -> dict[str, Any]:
    """How a unit-based stage ran: units planned, run now, resumed from an earlier attempt."""
    if results is None:
        return {}
    ops = {"units": results.units, "units_run": results.ran, "units_resumed": results.skipped,
           "worker_peak_rss_mb": results.worker_peak_rss_mb(), "ray_nodes": len(results.nodes())}
    return ops if results.detail_uri is None else {**ops, "units_detail": results.detail_uri}  # every unit's summary


def ops_metadata(units: UnitResults | Mapping[str, UnitResults] | None = None, seconds: float | None = None,
                 **counters: Any) -> dict[str, Any]:
    """The operational counters as one JSON entry `ops` (kept out of the Plots tab) and, given the
    run's seconds, a readable `duration`. A mapping of units is per phase (`route`, `chunk`, ...)."""
    if isinstance(units, Mapping):
        ops = {f"{phase}_{k}": v for phase, r in units.items() for k, v in units_ops(r).items()}
    else:
        ops = units_ops(units)
    ops.update({k: v for k, v in counters.items() if v is not None})
    if seconds is None:
        return {"ops": dg.MetadataValue.json(ops)}
    return {"duration": human_seconds(seconds), "ops": dg.MetadataValue.json({**ops, "seconds": round(seconds, 2)})}


def stage_metadata(report: Any, **counters: Any) -> dict[str, Any]:
    """`duration`, `ops` and `lance_versions` of any stage's report, read through its summary
    (`prx_core.stages.report`), plus the asset's own `counters` in `ops`."""
    summary = report.summary()
    return {**ops_metadata(summary.units, summary.seconds, **counters), **lance_versions(**summary.versions)}


def lance_versions(**versions: int | None) -> dict[str, Any]:
    """`lance_versions`: {table: version} of the versions read and written (the run's lineage)."""
    return {"lance_versions": dg.MetadataValue.json({t: int(v) for t, v in versions.items() if v is not None})}


def arrow_schema(schema: pa.Schema) -> dg.TableSchema:
    return dg.TableSchema(columns=[dg.TableColumn(f.name, str(f.type)) for f in schema])


def mds_schema(latents: Mapping[str, Any] | None = None) -> dg.TableSchema:
    """The columns of every MDS stream, with their streaming encodings (and the text latents' when configured)."""
    columns = MDS_COLUMNS | (latent_columns(latents["preset"], latents["masks"]) if latents else {})
    return dg.TableSchema(columns=[dg.TableColumn(name, encoding) for name, encoding in columns.items()])


def dataset_metadata(store: Any, rows: int, *, table: str | None = None, uri: str | None = None,
                     schema: dg.TableSchema | None = None) -> dict[str, Any]:
    """Dagster's entries for what the partition holds: its row count, its columns (a Lance table's
    Arrow schema, the contract its writers enforce: no I/O) and where it lives, plus the corpus root."""
    where = uri or store.lance_uri(table)
    columns = schema or (arrow_schema(TABLES[table]) if table else None)
    return {"dagster/row_count": dg.MetadataValue.int(int(rows)),
            **({"dagster/column_schema": dg.MetadataValue.table_schema(columns)} if columns else {}),
            "dagster/uri": where_value(where), "prx/root": where_value(store.root)}


def where_value(uri: str) -> dg.MetadataValue:
    return dg.MetadataValue.url(uri) if is_remote(uri) else dg.MetadataValue.path(uri)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ") if value is not None else ""
