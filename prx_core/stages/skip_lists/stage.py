"""Stage `skip_lists`: what training should not see, per stream and reason, without rewriting
shards. Changing the policy re-materializes only this stage.

Two passes of work units over the source's published streams (each stream's lists end with its
completion record, `prx_core.shards.skiplists.records`, so the loader refuses a stream this stage has
not finished for its current index); the driver holds one entry per
stream and per chunk. Per chunk (the chunk's own record lists its samples in stream order) a
worker looks up the chunk's losing duplicates by sample_id and its labels by caption key (batched
IN-list lookups on the shared tables), matches opt-outs, and writes the chunk's skipped
positions to scratch; per stream a worker concatenates them in chunk order and writes the
stream's skip-lists, bound to the digest of the index.json they were computed for. Declared as
`SKIP_LISTS` and run by `run_partition`; `build_skip_lists` is the typed call.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.compute.units import Unit, UnitResults, UnitRun
from prx_core.shards.manifest_publish import publish_source_manifest, source_in_manifests
from prx_core.shards.mds.merged import merged_current
from prx_core.shards.mds.rewrite import current_record, stream_chunks
from prx_core.shards.mds.streams import BUCKET_FOLDER, list_streams, read_chunk_record
from prx_core.shards.skiplists.files import remove_stale_streams, stream_folder, stream_key, write_stream_lists
from prx_core.shards.skiplists.records import UnfilteredStream
from prx_core.stages.report import StageReport
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, run_partition
from prx_core.stages.unchanged import last_commit
from prx_core.store import lance_io
from prx_core.store.lookups import lookup_keys
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage, join_uri

SKIP_LABELS = ("text", "nsfw")
SCRATCH_SCHEMA = pa.schema([("index", pa.int64()), ("sample_id", pa.string()), ("reason", pa.string())])


@dataclass(frozen=True)
class SkipPolicy:
    """Which samples to skip: duplicates that lose to a keeper, labels, explicit opt-outs, and
    (while labels are skipped) samples without a label: `caption_labels_coverage` passes below
    its threshold with a few labeller failures, and a sample whose label is unknown is not
    known to be free of text or nsfw, so it is skipped (reason `unlabelled`) rather than trained on."""

    duplicates: bool = True
    labels: tuple[str, ...] = SKIP_LABELS
    opt_out: tuple[str, ...] = ()  # source_keys or sample_ids
    unlabelled: bool = True

    def version(self) -> str:
        payload = json.dumps(asdict(self), sort_keys=True)
        return "policy-" + hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclass
class StreamSkips:
    stream: str  # "<tier>/<w>x<h>"
    size: int
    skipped: int  # union over reasons
    by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.skipped / max(self.size, 1)


@dataclass
class SkipReport(StageReport):
    ROWS = "samples"

    source: str
    streams: list[StreamSkips]
    files: list[str]
    read_versions: dict[str, int] = field(default_factory=dict)
    units: dict[str, UnitResults] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(s.size for s in self.streams)

    @property
    def skipped(self) -> int:
        return sum(s.skipped for s in self.streams)


def skip_chunk_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: the skipped positions of one chunk, by reason, written to scratch."""
    storage, params, inputs = run.storage, run.manifest.params, run.manifest.inputs
    options = storage.lance_storage_options()
    record = read_chunk_record(join_uri(unit.spec["stream_uri"], unit.spec["chunk"]), storage.storage_options)
    record = record.filter(pc.field("reason").is_null())
    ids, contents = record["sample_id"].to_pylist(), record["caption_key"].to_pylist()  # labels are keyed by caption
    reasons: list[tuple[str, set[str], list[str]]] = []  # (reason, hits, the column they match)
    if params["duplicates"] and inputs.get("duplicates") is not None:
        losers = lookup_keys(storage.lance_uri("duplicates"), "sample_id", ids, ["sample_id"], "NOT keeper",
                             options, inputs["duplicates"])
        reasons.append(("duplicate", set(losers["sample_id"].to_pylist()), ids))
    if params["labels"] and inputs.get("caption_labels") is not None:
        where = (f"captioner_version = {lance_io.sql_literal(params['captioner_version'])} AND labeler_version = "
                 f"{lance_io.sql_literal(params['labeler_version'])}")
        labels = lookup_keys(storage.lance_uri("caption_labels"), "content_id", contents, ["content_id", "label"],
                             where, options, inputs["caption_labels"])
        for label in params["labels"]:
            hit = labels.filter(pc.field("label") == label)["content_id"].to_pylist()
            reasons.append((label, set(hit), contents))
        if params.get("unlabelled"):
            reasons.append(("unlabelled", set(contents) - set(labels["content_id"].to_pylist()), contents))
    wanted = set(params["opt_out"]) | recorded_opt_outs(storage, inputs.get("opt_out_records") or [], ids)
    if wanted:
        keys = [sid if sid in wanted else sid.split("/", 1)[1] for sid in ids]  # a sample_id or a source_key
        reasons.append(("opt_out", wanted, keys))
    rows: dict[str, list] = {"index": [], "sample_id": [], "reason": []}
    counts: Counter[str] = Counter()
    for reason, hits, column in reasons:
        for position, (sid, value) in enumerate(zip(ids, column)):
            if value in hits:
                rows["index"].append(unit.spec["offset"] + position)
                rows["sample_id"].append(sid)
                rows["reason"].append(reason)
                counts[reason] += 1
    fs = storage.filesystem()
    path = run.scratch_uri("skips", unit.spec["label"].replace("/", "_"), f"{unit.spec['chunk']}.parquet")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as handle:
        pq.write_table(pa.table(rows, schema=SCRATCH_SCHEMA), handle)
    return {"rows": len(ids), "skipped": dict(counts)}


def skip_stream_unit(unit: Unit, run: UnitRun) -> dict[str, Any]:
    """Ray task: one stream's skip-lists from its chunks' scratch files, in chunk order."""
    storage, spec = run.storage, unit.spec
    fs = storage.filesystem()
    parts = []
    for chunk in spec["chunks"]:
        with fs.open(run.scratch_uri("skips", spec["label"].replace("/", "_"), f"{chunk}.parquet"), "rb") as handle:
            parts.append(pq.read_table(handle, pre_buffer=False))
    table = pa.concat_tables(parts) if parts else SCRATCH_SCHEMA.empty_table()
    lists = {}
    for reason in sorted(set(table["reason"].to_pylist())):
        part = table.filter(pc.field("reason") == reason).sort_by("index")
        lists[reason] = (part["index"].to_numpy(), part["sample_id"])
    tier, width, height = spec["stream"]
    header = {"source": run.manifest.partition, "tier": tier, "width": width, "height": height,
              "stream": stream_key(run.manifest.partition, tier, width, height), "stream_size": spec["size"],
              "policy_version": run.manifest.params["policy_version"], "index_digest": spec["digest"]}
    written = write_stream_lists(fs, stream_folder(storage.root, run.manifest.partition, tier, width, height),
                                 header, lists, applied_reasons(run.manifest.params, run.manifest.inputs))
    union = len(np.unique(table["index"].to_numpy())) if table.num_rows else 0
    return {"rows": spec["size"], "skipped": union, "by_reason": {r: len(v[0]) for r, v in lists.items()},
            "files": written}


def applied_reasons(params: dict[str, Any], inputs: dict[str, Any]) -> list[str]:
    """The reasons this run checked every sample for (what a stream's completion record lists):
    the policy's, less those whose table does not exist yet (no `duplicates` run, no labels)."""
    reasons = ["duplicate"] if params["duplicates"] and inputs.get("duplicates") is not None else []
    if params["labels"] and inputs.get("caption_labels") is not None:
        reasons += list(params["labels"]) + (["unlabelled"] if params.get("unlabelled") else [])
    return reasons + (["opt_out"] if params["opt_out"] or inputs.get("opt_out_records") else [])


def opt_out_records(storage: Storage, source: str) -> list[str]:
    """The ids files `prx-corpus opt-out` recorded for the source: every later run applies them."""
    fs, folder = storage.filesystem(), storage.uri("_state", "opt_out", source)
    fs.invalidate_cache()
    if not fs.isdir(folder):
        return []
    return sorted(p for p in fs.ls(folder, detail=False) if p.endswith(".ids.parquet"))  # paths of this fs


def recorded_opt_outs(storage: Storage, records: list[str], ids: list[str]) -> set[str]:
    """Which of a chunk's ids the recorded opt-outs name, read file by file with the chunk's ids
    as the filter (a source's records may hold millions of ids; a chunk holds thousands)."""
    if not records or not ids:
        return set()
    wanted, fs = pa.array(ids, pa.string()), storage.filesystem()
    hits: set[str] = set()
    for uri in records:
        with fs.open(uri, "rb") as handle:
            column = pq.read_table(handle, columns=["sample_id"])["sample_id"]
        hits.update(column.filter(pc.is_in(column, value_set=wanted)).to_pylist())
    return hits


def plan_streams(storage: Storage, source: str) -> list[dict[str, Any]]:
    """Per stream (published, or a member of a merged one): key, size, index digest, and its chunks
    with their first position."""
    plans = []
    published = set(list_streams(storage.root, source, storage.storage_options))
    for uri in list_streams(storage.root, source, storage.storage_options, members=True):
        tier, bucket = uri.rstrip("/").rsplit("/", 2)[-2:]
        size = BUCKET_FOLDER.fullmatch(bucket)
        data, chunks = stream_chunks(storage, uri)
        plans.append({"uri": uri, "stream": [int(tier), int(size[1]), int(size[2])], "label": f"{tier}/{bucket}",
                      "digest": hashlib.sha256(data).hexdigest(), "chunks": dict(chunks),
                      "member": uri not in published})
    return plans


def pin_streams(run: StageRun[SkipListsSettings]) -> dict[str, Any]:
    """The published streams (their index digests), the `duplicates` and `caption_labels` versions
    and the recorded opt-outs (a new opt-out is a new attempt); the policy enters the manifest as
    its fields and version; the chunk and stream units are planned from the streams' indexes."""
    storage, options = run.storage, run.storage.lance_storage_options()
    streams = run.state["streams"] = plan_streams(storage, run.partition)
    policy: SkipPolicy = run.params.pop("policy")
    run.params.update({**asdict(policy), "policy_version": policy.version()})
    versions = {t: lance_io.table_version(storage.lance_uri(t), options) for t in ("duplicates", "caption_labels")}
    run.state["chunks"], run.state["stream_units"] = plan_units(streams)
    return {**versions, "losers": losers_digest(storage, run.partition, versions["duplicates"]),
            "labels_run": last_commit(storage, "caption_labels", run.partition),  # volatile caption_labels: ours
            "streams": hashlib.sha256("".join(p["digest"] for p in streams).encode()).hexdigest(),
            "opt_out_records": opt_out_records(storage, run.partition)}


def lists_in_place(run: StageRun[SkipListsSettings], report: SkipReport) -> bool:
    """Every pinned stream still has the completion record of its current index and this policy,
    and the lists it counts, and the tier manifests hold the source's streams as they are now."""
    for plan in run.state["streams"]:
        try:
            record = current_record(run.storage, run.partition, tuple(plan["stream"]), plan["uri"])
        except UnfilteredStream:
            return False
        if record.get("policy_version") != run.params["policy_version"]:
            return False
        if plan["member"] and not merged_current(run.storage.root, tuple(plan["stream"]), run.storage.storage_options):
            return False
    digests = {stream_key(run.partition, *p["stream"]): p["digest"] for p in run.state["streams"] if not p["member"]}
    return source_in_manifests(run.storage.root, run.partition, digests, run.storage.storage_options)


def losers_digest(storage: Storage, source: str, version: int | None) -> str | None:
    """The source's losing duplicates at `version`, digested (order-free, streamed): a `duplicates`
    run that changed no loser of this source leaves it, and so the source's lists, as they were."""
    if version is None:
        return None
    return lance_io.partition_digest(storage.lance_uri("duplicates"), f"{source_predicate(source)} AND NOT keeper",
                                     ["sample_id"], storage.lance_storage_options(), version)


def plan_units(streams: list[dict[str, Any]]) -> tuple[list[Unit], list[Unit]]:
    """One unit per chunk (with its first position in the stream), one per stream."""
    chunk_units, stream_units = [], []
    for plan in streams:
        offset = 0
        for chunk, count in plan["chunks"].items():
            spec = {"stream_uri": plan["uri"], "label": plan["label"], "chunk": chunk, "offset": offset}
            chunk_units.append(Unit(f"chunk-{plan['label'].replace('/', '-')}-{chunk}", count, spec))
            offset += count
        spec = {**{k: plan[k] for k in ("stream", "label", "digest")}, "chunks": list(plan["chunks"]), "size": offset}
        stream_units.append(Unit(f"stream-{plan['label'].replace('/', '-')}", offset, spec))
    return chunk_units, stream_units


def write_skips(run: StageRun[SkipListsSettings]) -> None:
    run.units("chunks", run.state["chunks"], skip_chunk_unit)
    run.units("streams", run.state["stream_units"], skip_stream_unit, progress=False)


def remove_stale(run: StageRun[SkipListsSettings]) -> dict[str, int | None]:
    """The lists are written in place: what is left to make them the source's is removing the
    lists of streams no longer published. No table is written."""
    remove_stale_streams(run.storage.filesystem(), run.storage.root, run.partition,
                         {tuple(p["stream"]) for p in run.state["streams"]})
    publish_source_manifest(run.storage.root, run.partition, run.storage.storage_options)
    return {}


def report_skips(run: StageRun[SkipListsSettings]) -> SkipReport:
    written = run.results["streams"]
    streams = [StreamSkips(p["label"], s["rows"], s["skipped"], s["by_reason"])
               for p, s in zip(run.state["streams"], written.summaries)]
    read = {k: run.inputs[k] for k in ("duplicates", "caption_labels") if run.inputs[k] is not None}
    return SkipReport(run.partition, streams, [f for s in written.summaries for f in s["files"]], read,
                      dict(run.results))


@dataclass(frozen=True, kw_only=True)
class SkipListsSettings(Settings):
    """The `skip_lists` settings: whose captions and labels, and the policy (pinned as its fields and
    version: `pin_streams`)."""

    captioner_version: str
    labeler_version: str
    policy: SkipPolicy


SKIP_LISTS: Stage[SkipListsSettings] = Stage(
    "skip_lists", reads=("mds", "duplicates", "caption_labels"), writes=("skiplists", "manifests"),  # files
    after=("mds_shards", "duplicates", "caption_labels"),
    code_version="4", report_type=SkipReport,  # 3: completion records, 4: tier manifests
    settings=SkipListsSettings,
    phases=("chunks", "streams"), pin=pin_streams, work=write_skips, commit=remove_stale, report=report_skips,
    # every `duplicates` run makes every source's lists stale in Dagster: a source whose losers, streams,
    # labels and opt-outs are what its last lists were computed from reruns as a no-op, and a crashed run
    # resumes across other sources' commits. Its labels are those of its own `caption_labels` run
    # (`labels_run`): another source's run labels only contents without a label for this version
    reusable=lambda report: True, volatile=("duplicates", "caption_labels"), present=lists_in_place,
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(SkipPolicy, SkipReport, StreamSkips)
# their names before this module moved into the skip_lists package: a reused run's report is recorded under them
wire.register_moved_from("prx_core.stages.skip_lists", SkipPolicy, SkipReport, StreamSkips)


def build_skip_lists(source: str, storage: Storage, captioner_version: str, labeler_version: str, policy: SkipPolicy,
                     progress: Throttle | None = None) -> SkipReport:
    """`skip_lists` of one source (`run_partition` of SKIP_LISTS)."""
    return run_partition(SKIP_LISTS, storage, source, progress=progress, captioner_version=captioner_version,
                         labeler_version=labeler_version, policy=policy)
