"""`skip_lists` as work units (per chunk, then per stream) on a real local Ray: the same lists as a
reference computed from `mds_index` and the label and duplicate tables, bound to the stream's
index.json, loaded by the training loader, and refused by it once the stream is republished."""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
import pytest
from test_mds_stage import CAPTIONER, add_captions
from test_row_stages import make_samples

from prx_core.compute.parallel import Throttle
from prx_core.shards.loader import CorpusDataset
from prx_core.shards.skiplists.files import index_digest, read_skip_lists
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
LABELER = "lab-v1"


@pytest.fixture()
def storage(tmp_path) -> Storage:
    storage = Storage(str(tmp_path / "corpus"))
    make_samples(storage, "photos", 40, 3)
    add_captions(storage, skip=0)
    build_mds("photos", storage, CAPTIONER, route_rows=7, chunk_rows=3)
    index = lance_io.read_table(storage.lance_uri("mds_index")).sort_by("sample_id").to_pylist()
    labels = [{"content_id": r["content_id"], "captioner_version": CAPTIONER, "labeler_version": LABELER,
               "labeler_id": "t", "label": ("text", "nsfw", "visual", "visual")[i % 4], "score": 1.0}
              for i, r in enumerate(index)]
    lance_io.upsert(storage.lance_uri("caption_labels"), pa.Table.from_pylist(labels, schema=schemas.CAPTION_LABELS),
                    ["content_id", "captioner_version", "labeler_version"])
    losers = [{"sample_id": r["sample_id"], "source": "photos", "group_id": "g", "group_size": 2, "keeper": i % 5 != 0,
               "keeper_sample_id": "x", "pixels": 1} for i, r in enumerate(index)]
    lance_io.overwrite(storage.lance_uri("duplicates"), pa.Table.from_pylist(losers, schema=schemas.DUPLICATES))
    return storage


def reference(storage: Storage, policy: SkipPolicy) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """(stream, reason) -> [(index, sample_id)] from the committed tables, in plain Python."""
    index = lance_io.read_table(storage.lance_uri("mds_index"), filter=source_predicate("photos")).to_pylist()
    labels = {r["content_id"]: r["label"] for r in lance_io.read_table(storage.lance_uri("caption_labels")).to_pylist()}
    losers = {r["sample_id"] for r in lance_io.read_table(storage.lance_uri("duplicates")).to_pylist() if not r["keeper"]}
    out: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    for row in sorted(index, key=lambda r: r["index"]):
        stream = f"photos/{row['tier']}/{row['bucket']}"
        if policy.duplicates and row["sample_id"] in losers:
            out[(stream, "duplicate")].append((row["index"], row["sample_id"]))
        if labels.get(row["content_id"]) in policy.labels:
            out[(stream, labels[row["content_id"]])].append((row["index"], row["sample_id"]))
        if row["sample_id"] in policy.opt_out or row["sample_id"].split("/", 1)[1] in policy.opt_out:
            out[(stream, "opt_out")].append((row["index"], row["sample_id"]))
    return dict(out)


def test_skip_lists_equal_the_reference_and_bind_to_their_stream(storage: Storage) -> None:
    policy = SkipPolicy(opt_out=("k000", "photos/k001"))
    report = build_skip_lists("photos", storage, CAPTIONER, LABELER, policy)
    got = {(s.stream, s.reason): list(zip(s.indices, s.sample_ids)) for s in read_skip_lists(storage.root, "photos")}
    assert got == reference(storage, policy)
    assert {r for _, r in got} == {"duplicate", "text", "nsfw", "opt_out"}
    assert report.units["chunks"].units > len(report.streams)  # several chunks per stream
    for skip in read_skip_lists(storage.root, "photos"):
        stream = f"{storage.root}/mds/photos/{skip.tier}/{skip.width}x{skip.height}"
        assert skip.index_digest == index_digest(stream) and skip.policy_version == policy.version()
    assert report.skipped == sum(s.skipped for s in report.streams) > 0
    lines: list[str] = []
    narrower = build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy(duplicates=False, labels=("nsfw",)),
                                progress=Throttle(lines.append, "skip[photos]", unit="chunks"))
    assert lines and {line.split(": ")[0] for line in lines} == {"skip[photos]"}  # the chunks; streams are quick
    assert {s.reason for s in read_skip_lists(storage.root, "photos")} == {"nsfw"}  # stale reasons removed
    assert narrower.skipped < report.skipped


def test_the_loader_takes_the_lists_and_refuses_them_for_a_republished_stream(storage: Storage) -> None:
    build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy())
    skipped = {sid for s in read_skip_lists(storage.root, "photos") for sid in s.sample_ids}
    tier = read_skip_lists(storage.root, "photos")[0].tier
    with pytest.warns(UserWarning):  # streams too small for a batch are left out
        dataset = CorpusDataset(storage.root, tier, batch_size=1, shuffle=False)
    read = [s["sample_id"] for s in dataset]
    del dataset
    assert read and not set(read) & skipped
    build_mds("photos", storage, CAPTIONER, route_rows=7, chunk_rows=5)  # republished in other chunks
    with pytest.raises(ValueError, match="re-materialize skip_lists for photos"):
        CorpusDataset(storage.root, tier, batch_size=1, shuffle=False)


def test_every_stream_gets_a_completion_record_also_with_nothing_to_skip(storage: Storage) -> None:
    """A policy that skips nothing writes no list but a record per stream, which is what lets the
    loader tell "nothing to skip" from "skip_lists never ran"; before it ran, the loader refuses."""
    from prx_core.shards.mds.streams import list_streams
    from prx_core.shards.skiplists.records import UnfilteredStream, read_record

    build_mds("photos", storage, CAPTIONER)  # republished: the records of earlier tests are stale now
    tier = int(list_streams(storage.root, "photos")[0].rstrip("/").rsplit("/", 2)[-2])
    with pytest.raises(UnfilteredStream, match="materialize skip_lists for (source 'photos'|photos)"):
        CorpusDataset(storage.root, tier, batch_size=1, shuffle=False)
    nothing = SkipPolicy(duplicates=False, labels=(), unlabelled=False)
    report = build_skip_lists("photos", storage, CAPTIONER, LABELER, nothing)
    assert report.skipped == 0 and read_skip_lists(storage.root, "photos") == []
    fs = storage.filesystem()
    for stream in list_streams(storage.root, "photos"):
        folder = stream.replace("/mds/", "/skiplists/", 1)
        record = read_record(fs, folder)
        assert record is not None and record["index_digest"] == index_digest(stream), stream
        assert record["counts"] == {} and record["reasons_applied"] == [] and record["policy_version"] == nothing.version()
    dataset = CorpusDataset(storage.root, tier, batch_size=1, shuffle=False)
    assert len([s["sample_id"] for s in dataset]) > 0


def test_a_duplicates_run_that_changed_no_loser_of_the_source_leaves_its_lists_as_they_are(storage: Storage) -> None:
    """Issue 24, hazard 9: every `duplicates` run makes every source's lists stale in Dagster; a
    source whose losers did not change reruns as a no-op, one whose losers changed is recomputed,
    and lists deleted behind the stage's back are written again."""
    from prx_core.shards.skiplists.files import source_folder

    policy = SkipPolicy()
    first = build_skip_lists("photos", storage, CAPTIONER, LABELER, policy)
    assert first.units["chunks"].ran > 0
    duplicates = lance_io.read_table(storage.lance_uri("duplicates"))
    other = pa.Table.from_pylist([{"sample_id": "web/x", "source": "web", "group_id": "h", "group_size": 2,
                                   "keeper": False, "keeper_sample_id": "web/y", "pixels": 1}],
                                 schema=schemas.DUPLICATES)
    lance_io.overwrite(storage.lance_uri("duplicates"), pa.concat_tables([duplicates, other]))  # another source's
    lines: list[str] = []
    again = build_skip_lists("photos", storage, CAPTIONER, LABELER, policy, progress=Throttle(lines.append, "skip"))
    assert again.units["chunks"].ran == 0 and again.skipped == first.skipped
    assert any("nothing to run" in line for line in lines), lines

    flipped = duplicates.to_pylist()
    flipped[2]["keeper"] = False  # one more of this source's rows loses (its label is "visual": not skipped yet)
    lance_io.overwrite(storage.lance_uri("duplicates"), pa.Table.from_pylist(flipped, schema=schemas.DUPLICATES))
    changed = build_skip_lists("photos", storage, CAPTIONER, LABELER, policy)
    assert changed.units["chunks"].ran > 0 and changed.skipped == first.skipped + 1

    storage.filesystem().rm(source_folder(storage.root, "photos"), recursive=True)
    rewritten = build_skip_lists("photos", storage, CAPTIONER, LABELER, policy)
    assert rewritten.units["chunks"].ran > 0 and read_skip_lists(storage.root, "photos")
