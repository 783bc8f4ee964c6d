"""Work units for the stages that run a model once per content (`captions`, `caption_labels`,
`caption_embeddings`): which contents a unit owns and what it still has to compute.

A unit owns a range of content ids (prx_core.compute.key_ranges: equal ranges of the SHA-256
key space), so every content of the source is handled by exactly one unit, from its first bucketed
sample (smallest `sample_id`). The unit finds its samples and buckets by range reads of their
`content_id` BTREEs, and asks "which of these contents still need a row for this model version"
on the worker, as IN-list lookups on the shared table's `content_id` BTREE index: its keys sit
together in the index, so both read a few pages whatever the tables' sizes (a row range of
`samples` held random keys, whose lookups touched nearly every page: docs/scale.md). No set of the
corpus's contents is ever built on the driver.
Rows reach the shared table through `prx_core.upkeep.appends.BatchedAppend`. The steps the three
stages share (`pin_contents`, `model_units`, `commit_appends`) live here; the vLLM path's work
step is `prx_core.stages.model_pipeline.pipeline_units`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute.actors import ModelHost
from prx_core.compute.key_ranges import plan_partition_ranges, range_predicate
from prx_core.compute.units import ModelSpec, ModelUnitFn, Unit, UnitResults, UnitRun
from prx_core.models.caption_keys import caption_keys, keyed_by_text
from prx_core.stages.stage import StageRun
from prx_core.stages.unchanged import last_commit
from prx_core.store import lance_io, schemas
from prx_core.store.lookups import lookup_keys, lookup_where, shipped_filter
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage
from prx_core.upkeep.appends import BatchedAppend

UNIT_ROWS = 4096  # samples per unit: minutes of GPU work, so a crash loses little
CONTENT_VOLATILE = ("samples", "buckets")  # pinned inputs other sources move: out of the attempt's identity
FAILED_EXAMPLES = 100  # offending contents a stage reports (per unit and in all) for its coverage check
T = TypeVar("T")


def plan_content_units(storage: Storage, source: str, unit_rows: int = UNIT_ROWS) -> tuple[dict[str, int], list[Unit]]:
    """(pinned `samples` and `buckets` versions, units) for one source: ranges of content ids of
    `unit_rows` of its samples each (`plan_partition_ranges`), once `buckets` exists (the units
    read the bucketed rows of their range)."""
    buckets = lance_io.open_table(storage.lance_uri("buckets"), storage.lance_storage_options())
    if buckets is None:
        raise RuntimeError("the buckets table does not exist yet: materialize `buckets` first")
    version, units = plan_partition_ranges(storage.lance_uri("samples"), "content_id", source_predicate(source),
                                           unit_rows, storage.lance_storage_options())
    return {"samples": version, "buckets": buckets.version}, units


def range_rows(storage: Storage, inputs: Mapping[str, int], source: str, spec: Mapping[str, Any],
               columns: list[str]) -> tuple[pa.Table, pa.Table]:
    """The unit's range of the source: (its samples' `columns` with their `_rowaddr`, its bucketed
    samples' content_id and sample_id), each a range read of the table's `content_id` BTREE."""
    options, where = storage.lance_storage_options(), source_predicate(source)
    keys = range_predicate("content_id", spec)
    rows = lookup_where(storage.lance_uri("samples"), columns, f"{where} AND {keys}", options, inputs["samples"],
                        with_row_address=True)
    bucketed = lookup_where(storage.lance_uri("buckets"), ["content_id", "sample_id"],
                            f"{where} AND tier IS NOT NULL AND {keys}", options, inputs["buckets"])
    return rows, bucketed


def owned_contents(storage: Storage, inputs: Mapping[str, int], source: str, spec: Mapping[str, Any]) -> pa.Table:
    """(content_id, sample_id, _rowaddr in `samples`) of the bucketed contents of the unit's range,
    each with its first bucketed sample, one row per content, sorted by content_id."""
    rows, bucketed = range_rows(storage, inputs, source, spec, ["sample_id", "content_id"])
    first = bucketed.group_by("content_id").aggregate([("sample_id", "min")])
    mine = rows.join(first, "content_id", join_type="inner")
    mine = mine.filter(pc.equal(mine["sample_id"], mine["sample_id_min"]))
    mine = mine.group_by("content_id").aggregate([("sample_id", "min"), ("_rowaddr", "min")])  # repeated sample_ids
    mine = mine.rename_columns(["content_id", "sample_id", "_rowaddr"])
    return mine.sort_by("content_id")


OWNED_COLUMNS = ["content_id", "caption_key", "sample_id", "_rowaddr"]


def owned_captions(storage: Storage, inputs: Mapping[str, int], source: str, spec: Mapping[str, Any],
                   captioner_version: str) -> pa.Table:
    """(content_id, caption_key, sample_id, _rowaddr of that sample) of the captions this unit owns,
    one row per caption key (prx_core.models.caption_keys), sorted by it. A model caption's key is
    its content: the unit's owned contents. Under the `source` captioner every (content, source
    caption) pair of the content's bucketed samples in the source is a key, from its first sample;
    all of a content's samples share its content id, so they are all in the unit's range."""
    if not keyed_by_text(captioner_version):
        owned = owned_contents(storage, inputs, source, spec)
        return owned.append_column("caption_key", owned["content_id"]).select(OWNED_COLUMNS)
    columns = ["sample_id", "content_id", "original_caption"]
    rows, bucketed = range_rows(storage, inputs, source, spec, columns)
    here = rows.filter(pc.is_in(rows["sample_id"], bucketed["sample_id"]))
    if here.num_rows == 0:
        return pa.table({c: pa.array([], pa.uint64() if c == "_rowaddr" else pa.string()) for c in OWNED_COLUMNS})
    keys = caption_keys(captioner_version, here["content_id"].to_pylist(), here["original_caption"].to_pylist())
    keyed = here.append_column("caption_key", pa.array(keys, pa.string()))
    keyed = keyed.sort_by([("caption_key", "ascending"), ("sample_id", "ascending"), ("_rowaddr", "ascending")])
    firsts = keyed.group_by("caption_key", use_threads=False).aggregate(
        [("content_id", "first"), ("sample_id", "first"), ("_rowaddr", "first")])
    return firsts.rename_columns(["caption_key", "content_id", "sample_id", "_rowaddr"]).select(OWNED_COLUMNS)


def stored_rows(storage: Storage, table: str, content_ids: Sequence[str], columns: list[str], where: str) -> pa.Table:
    """The shared table's rows for these contents (newest version: what earlier commits hold);
    none before the table's first commit."""
    empty = pa.table({c: pa.array([], pa.string()) for c in columns})
    if not content_ids:
        return empty
    try:  # one open per lookup, through the process's lookup cache, not an existence check beside it
        return lookup_keys(storage.lance_uri(table), "content_id", content_ids, columns, where,
                           storage.lance_storage_options())
    except lance_io.TableNotFoundError:
        return empty


def captioned_pending(unit: Unit, run: UnitRun, table: str, model_column: str,
                      columns: Sequence[str] = ("content_id",)) -> tuple[pa.Table, pa.Table, pa.Table]:
    """For a stage that models captions: the unit's owned captions (`owned_captions`: their keys
    in `content_id`, the column the shared tables key by) with a shipped caption of the run's
    captioner (content_id, caption), their `columns` in `table` for the run's captioner and
    `model_column` version, and the captions without such a row (what the model still has to do).
    A caption the checks rejected is never shipped, so nothing is computed from it."""
    params = run.manifest.params
    owned = owned_captions(run.storage, run.manifest.inputs, run.manifest.partition, unit.spec,
                           params["captioner_version"])
    captioner = f"captioner_version = {lance_io.sql_literal(params['captioner_version'])}"
    keys = owned["caption_key"].to_pylist()
    shipped = shipped_filter(run.storage, params["captioner_version"]) if keys else ""
    captions = stored_rows(run.storage, "captions", keys, ["content_id", "caption"], shipped).sort_by("content_id")
    stored = stored_rows(run.storage, table, captions["content_id"].to_pylist(), list(columns),
                         f"{captioner} AND {model_column} = {lance_io.sql_literal(params[model_column])}")
    return captions, stored, without(captions, stored["content_id"])


def offending_samples(storage: Storage, source: str, failures: Sequence[Sequence[str]],
                      buckets_version: int | None = None) -> list[dict[str, str]]:
    """A coverage check's offenders: (content_id, reason) pairs -> rows naming the sample that owns
    each content (its first bucketed sample in the source), from one lookup on `buckets`' content_id
    index; a (content_id, reason, sample_id) triple names its sample itself. At most
    FAILED_EXAMPLES, sorted by sample_id."""
    failures = list(failures)[:FAILED_EXAMPLES]
    reasons = {str(f[0]): str(f[1]) for f in failures}
    named = {str(f[0]): str(f[2]) for f in failures if len(f) > 2 and f[2]}
    if not reasons:
        return []
    first: dict[str, str] = dict(named)
    image = source_caption_contents(storage, sorted(set(reasons) - set(named)))  # caption key -> its content
    if unnamed := sorted({image.get(c, c) for c in set(reasons) - set(named)}):
        owners = lookup_keys(storage.lance_uri("buckets"), "content_id", unnamed, ["content_id", "sample_id"],
                             f"{source_predicate(source)} AND tier IS NOT NULL", storage.lance_storage_options(),
                             buckets_version)
        for content, sample in zip(owners["content_id"].to_pylist(), owners["sample_id"].to_pylist()):
            first[content] = min(first.get(content, sample), sample)
    rows = [{"sample_id": first.get(c) or first.get(image.get(c, c), ""), "content_id": image.get(c, c), "reason": r}
            for c, r in reasons.items()]
    return sorted(rows, key=lambda row: (row["sample_id"], row["content_id"]))


def source_caption_contents(storage: Storage, keys: Sequence[str]) -> dict[str, str]:
    """caption key -> content of the `source` captioner's keys among `keys` (a model stage's
    failures name caption keys; its offenders name the sample of the key's content)."""
    found = stored_rows(storage, "captions", list(keys), ["content_id", "image_content_id"],
                        "image_content_id IS NOT NULL") if keys and has_column(storage, "image_content_id") else None
    return {} if found is None else dict(zip(found["content_id"].to_pylist(), found["image_content_id"].to_pylist()))


def has_column(storage: Storage, column: str) -> bool:
    ds = lance_io.open_table(storage.lance_uri("captions"), storage.lance_storage_options())
    return ds is not None and column in ds.schema.names


def without(table: pa.Table, content_ids: Sequence[str] | pa.Array) -> pa.Table:
    """`table`'s rows whose content_id is not in `content_ids`."""
    return table.filter(pc.invert(pc.is_in(table["content_id"], pa.array(list(content_ids), pa.string()))))


def prefetched(loads: Sequence[Callable[[], T]]) -> Iterator[T]:
    """Each load's result in order, the next one running in a thread while the caller uses the
    current one (image reads overlap model calls)."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(loads[0]) if loads else None
        for index in range(len(loads)):
            result = future.result()
            future = pool.submit(loads[index + 1]) if index + 1 < len(loads) else None
            yield result


def model_batches(host: ModelHost, rows: pa.Table, batch_size: int) -> tuple[list[Any], float]:
    """The model's output for each batch of `rows` (every column, as lists), and the seconds it worked."""
    outputs, busy = [], 0.0
    for start in range(0, rows.num_rows, batch_size):
        batch = rows.slice(start, batch_size)
        out, seconds = host.run({name: batch[name].to_pylist() for name in batch.column_names})
        outputs.append(out)
        busy += seconds
    return outputs, busy


def pin_contents(run: StageRun, appends: BatchedAppend, follows: Sequence[str] = ()) -> dict[str, int]:
    """A content stage's `pin`: the pinned `samples` and `buckets` versions, its units planned
    (`run.state["units"]`); first appends what recorded units of earlier attempts wrote and no
    commit took, since opening this attempt discards them (`run.state["appends"]` goes on).

    Both versions are `volatile` (CONTENT_VOLATILE): every other source's ingest moves them, and a
    crashed run resumes its attempt across those commits. What identifies it instead is the
    source's part of each (`source_reads`, in the params: a digest of its fragments, which other
    sources' commits leave as they were), so its units read the same rows at the same addresses
    whichever version they pinned; the resumed attempt reads on the versions it first pinned. The
    content tables it reads (`follows`: `captions`) enter as this source's last run of each
    (`last_commit`): a new caption of the source is a new manifest, so a committed run is reused
    only while the source's captions are the ones it read."""
    inputs, run.state["units"] = plan_content_units(run.storage, run.partition, run.settings.unit_rows)
    options = run.storage.lance_storage_options()
    run.params["source_reads"] = {
        t: lance_io.partition_signature(run.storage.lance_uri(t), source_predicate(run.partition), options, v)
        for t, v in inputs.items()} | {asset: last_commit(run.storage, asset, run.partition) for asset in follows}
    run.state["appends"] = appends
    appends.commit_recorded(UnitRun.recorded(run.storage, run.stage.name, run.partition))
    return inputs


def model_units(run: StageRun, unit_fn: ModelUnitFn, model: ModelSpec) -> None:
    """A content stage's `work` on model actors: each unit's rows reach the batched appends as it completes."""
    run.units("units", run.state["units"], unit_fn, model=model, on_result=run.state["appends"].add)


def commit_appends(run: StageRun) -> dict[str, int | None]:
    """A content stage's `commit`: the last append, and the new rows indexed; the version readers see."""
    return {run.stage.name: run.state["appends"].finish()}


def model_seconds(results: UnitResults) -> float:
    """Seconds the models spent inside the model, summed over units (floats: `total` counts whole numbers)."""
    return sum(float(s.get("model_seconds") or 0) for s in results.summaries)


def write_latents(storage: Storage, rows: pa.Table) -> dict[str, Any]:
    """`text_latents` rows (of `text_latents` or of a fused captioner) written as uncommitted fragments:
    their counts (summed in Arrow: a unit's latents are gigabytes at 8B) and the fragments."""
    written = lance_io.write_fragments(storage.lance_uri("text_latents"), rows, schemas.TEXT_LATENTS,
                                       storage.lance_storage_options()) if rows.num_rows else []
    return {"encoded": rows.num_rows, "tokens": int(pc.sum(rows["tokens"]).as_py() or 0),
            "latent_bytes": int(pc.sum(pc.binary_length(rows["latent"])).as_py() or 0),
            "fragments": [f.to_json() for f in written]}
