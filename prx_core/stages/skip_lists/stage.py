"""Stage `skip_lists`: what training should not see, per stream and reason, without rewriting
shards. Changing the policy re-materializes only this stage.

Two passes of work units over the source's published streams (each stream's lists end with its
completion record, `prx_core.shards.skiplists.records`, so the loader refuses a stream this stage
has not finished for its current index); the driver holds one entry per stream and per chunk. Per
chunk (the chunk's own record lists its samples in stream order) a worker looks up the chunk's
losing duplicates by sample_id and its labels by caption key (batched IN-list lookups on the
shared tables), matches opt-outs, and writes the chunk's skipped positions to scratch; per stream
a worker concatenates them in chunk order and writes the stream's skip-lists, bound to the digest
of the index.json they were computed for (the units: `prx_core.stages.skip_lists.units`).
Declared as `SKIP_LISTS` and run by `run_partition`; `build_skip_lists` is the typed call.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.compute.units import Unit, UnitResults
from prx_core.shards.manifest_publish import publish_source_manifest, source_in_manifests
from prx_core.shards.mds.merged import merged_current
from prx_core.shards.mds.rewrite import current_record, stream_chunks
from prx_core.shards.mds.streams import BUCKET_FOLDER, list_streams
from prx_core.shards.skiplists.files import remove_stale_streams, stream_key
from prx_core.shards.skiplists.records import UnfilteredStream
from prx_core.stages.report import StageReport
from prx_core.stages.settings import Settings
from prx_core.stages.skip_lists.units import skip_chunk_unit, skip_stream_unit
from prx_core.stages.stage import Stage, StageRun, run_partition
from prx_core.stages.unchanged import last_commit
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

SKIP_LABELS = ("text", "nsfw")


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


def opt_out_records(storage: Storage, source: str) -> list[str]:
    """The ids files `prx-corpus opt-out` recorded for the source: every later run applies them."""
    fs, folder = storage.filesystem(), storage.uri("_state", "opt_out", source)
    fs.invalidate_cache()
    if not fs.isdir(folder):
        return []
    return sorted(p for p in fs.ls(folder, detail=False) if p.endswith(".ids.parquet"))  # paths of this fs


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
