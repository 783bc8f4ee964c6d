"""`mds_shards` as work units (route, chunks, index) on a real local Ray, real Lance and real MDS
read back by mosaicml-streaming: the same samples, order, bytes and positions as a single-process
reference for any chunk size; reruns reuse complete chunks; a SIGKILL resumes; a republish never
breaks a reader holding the old index."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pytest
import streaming
from crash import kill_at, recorded_units
from streaming.base.util import clean_stale_shared_memory
from test_row_stages import make_samples

from prx_core.compute.parallel import Throttle
from prx_core.compute.units import RUNS
from prx_core.image.imaging import process_image
from prx_core.shards.mds.publish import write_source_streams
from prx_core.shards.mds.read import read_stream_rows
from prx_core.shards.mds.retention import prune_streams
from prx_core.shards.mds.streams import list_streams
from prx_core.shards.mds.verify import verify_streams
from prx_core.stages.mds_shards.chunks import NO_CAPTION
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.unchanged import force_next_run
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import rejects_predicate, source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
CAPTIONER = "cap-v1"


def add_captions(storage: Storage, skip: int = 1, text: str = "a picture") -> None:
    """A caption for every content of the corpus but the first `skip` of `photos` (no_caption)."""
    samples = lance_io.read_table(storage.lance_uri("samples"), ["sample_id", "content_id"])
    missing = set(sorted(r["content_id"] for r in samples.to_pylist() if r["sample_id"].startswith("photos/"))[:skip])
    rows = [{"content_id": c, "captioner_version": CAPTIONER, "captioner_id": "source", "prompt_version": "p",
             "caption": f"{text} {c[:8]}", "word_count": 3, "error": ""}
            for c in sorted(set(samples["content_id"].to_pylist()) - missing)]
    lance_io.upsert(storage.lance_uri("captions"), pa.Table.from_pylist(rows, schema=schemas.CAPTIONS),
                    ["content_id", "captioner_version"])


@pytest.fixture()
def storage(tmp_path: Path) -> Storage:
    storage = Storage(str(tmp_path / "corpus"))
    make_samples(storage, "other", 4, 1)
    make_samples(storage, "photos", 40, 3)
    add_captions(storage)
    return storage


def reference(storage: Storage, root: str) -> dict[str, list[tuple[str, str, str]]]:
    """The single-process reference: every bucketed, captioned sample, encoded in-process and
    written with one writer per stream, in sample_id order. stream -> [(id, sha256, caption)]."""
    samples = lance_io.read_table(storage.lance_uri("samples"), filter=source_predicate("photos")).to_pylist()
    captions = {r["content_id"]: r["caption"] for r in lance_io.read_table(storage.lance_uri("captions")).to_pylist()}
    rows = []
    for sample in sorted(samples, key=lambda s: s["sample_id"]):
        result = process_image(sample["image"])
        if hasattr(result, "reason") or sample["content_id"] not in captions:
            continue
        b = result.bucket
        rows.append({"tier": b.tier, "bucket_width": b.width, "bucket_height": b.height, "jpeg": result.jpeg,
                     "caption": captions[sample["content_id"]], "original_caption": sample["original_caption"] or "",
                     "width": b.width, "height": b.height, "original_width": result.original_size[0],
                     "original_height": result.original_size[1], "sample_id": sample["sample_id"], "source": "photos",
                     "content_id": sample["content_id"]})
    rows.sort(key=lambda r: (r["tier"], r["bucket_width"], r["bucket_height"], r["sample_id"]))
    return {s.uri[len(root):]: list(zip(s.sample_ids, s.image_sha256, [r["caption"] for r in rows
                                                                          if r["sample_id"] in set(s.sample_ids)]))
            for s in write_source_streams(rows, root, "photos")}


def streams(root: str) -> dict[str, list[tuple[str, str, str]]]:
    return {uri[len(root):]: [(r["sample_id"], hashlib.sha256(r["image"]).hexdigest(), r["caption"])
                              for r in read_stream_rows(uri)] for uri in list_streams(root, "photos")}


@pytest.mark.parametrize("chunk_rows", [2, 1000])
def test_chunked_streams_equal_the_single_process_reference(storage: Storage, tmp_path: Path, chunk_rows: int) -> None:
    report = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=chunk_rows)
    expected = reference(storage, str(tmp_path / "ref"))
    assert streams(storage.root) == {k: v for k, v in expected.items()}
    chunks = report.units["chunks"]
    assert chunks.units > len(report.streams) if chunk_rows == 2 else chunks.units == len(report.streams)
    assert report.units["route"].units == 9  # 42 samples in ranges of content ids of 5 samples each
    index = lance_io.read_table(storage.lance_uri("mds_index"), filter=source_predicate("photos")).to_pylist()
    for stream in report.streams:  # positions are the order in the published stream
        mine = sorted((r for r in index if (r["tier"], r["bucket"]) == (stream.tier, f"{stream.width}x{stream.height}")),
                      key=lambda r: r["index"])
        assert [r["index"] for r in mine] == list(range(stream.samples))
        assert [(r["sample_id"], r["image_sha256"]) for r in mine] == \
            [(sid, sha) for sid, sha, _ in expected[stream.uri[len(storage.root):]]]
    rejected = lance_io.read_table(storage.lance_uri("rejects"), filter=rejects_predicate("photos", "mds_shards"))
    assert NO_CAPTION in rejected["reason"].to_pylist() and report.rejects[NO_CAPTION] >= 1
    verified = verify_streams([s.uri for s in report.streams])
    assert verified.ok and verified.samples == report.written == len(index)
    assert not list(Path(storage.root, RUNS, "mds_shards", "photos").iterdir())


def test_a_rerun_reuses_complete_chunks_and_changes_no_byte(storage: Storage) -> None:
    lines: list[str] = []
    build_mds("photos", storage, CAPTIONER, progress=Throttle(lines.append, "mds[photos]", unit="chunks"),
              route_rows=5, chunk_rows=3)
    assert {line.split(": ")[0] for line in lines} == {"mds[photos]", "mds[photos] route", "mds[photos] index"}
    assert any(line.startswith("mds[photos]: ") and " chunks" in line for line in lines)  # the chunks, plainly
    before = {p: p.read_bytes() for p in Path(storage.root, "mds").rglob("*") if p.is_file()}
    again = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=3)  # the same reads: nothing runs
    assert (again.units["chunks"].ran, again.units["chunks"].skipped) == (0, again.units["chunks"].units)
    assert force_next_run(storage, "mds_shards", "photos")  # forced: every chunk found by its name
    forced = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=3)
    chunks = forced.units["chunks"]
    assert chunks.total("reused") == chunks.units > 0
    assert {p: p.read_bytes() for p in Path(storage.root, "mds").rglob("*") if p.is_file()} == before
    make_samples(storage, "photos", 40, 3)  # re-ingested: a new samples version, the same content
    third = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=3)
    chunks = third.units["chunks"]
    assert chunks.total("reused") == chunks.units > 0  # content-named chunks: nothing rewritten
    assert {p: p.read_bytes() for p in Path(storage.root, "mds").rglob("*") if p.is_file()} == before


def test_a_reader_holding_the_old_index_keeps_reading_while_the_stream_is_republished(storage: Storage,
                                                                                        tmp_path: Path) -> None:
    first = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=3)
    stream = max(first.streams, key=lambda s: s.samples)
    old_rows = [(r["sample_id"], hashlib.sha256(r["image"]).hexdigest()) for r in read_stream_rows(stream.uri)]
    clean_stale_shared_memory()
    local = tmp_path / "trainer-cache"
    reader = streaming.StreamingDataset(remote=stream.uri, local=str(local), shuffle=False, batch_size=1)
    add_captions(storage, skip=0, text="another picture")  # every caption changes: new chunk folders
    # written past the `captions` stage, whose commit record mds_shards follows: forget its own instead
    assert force_next_run(storage, "mds_shards", "photos")
    second = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=3)
    assert set(second.streams[0].chunks).isdisjoint(first.streams[0].chunks)
    read = [(reader[i]["sample_id"], hashlib.sha256(_raw_jpeg(reader, i)).hexdigest()) for i in range(reader.num_samples)]
    assert read == old_rows  # the old index's shards are all still there, byte for byte
    del reader
    report = prune_streams(storage.root, retention_seconds=0)  # the retention passed: now they go
    assert report.removed and verify_streams([s.uri for s in second.streams]).ok


def _raw_jpeg(dataset: streaming.StreamingDataset, index: int) -> bytes:
    """The stored bytes of a sample's image (the decoded PIL image would hide a re-encode)."""
    dataset[index]  # makes streaming fetch the shard into its cache
    shard_id, offset = dataset.spanner[index]
    shard = dataset.shards[shard_id]
    data = shard.get_sample_data(offset)
    sizes, pos = [], 0
    for size in shard.column_sizes:
        if size is None:
            size, pos = int.from_bytes(data[pos:pos + 4], "little"), pos + 4
        sizes.append(size)
    start = pos + sum(sizes[:shard.column_names.index("image")])
    return data[start:start + sizes[shard.column_names.index("image")]]


KILL_SCRIPT = """
import ray, sys
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.store.storage import Storage
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False)
build_mds("photos", Storage(sys.argv[1]), "cap-v1", route_rows=5, chunk_rows=2)
"""


def test_a_sigkilled_mds_run_resumes_and_never_exposes_a_partial_stream(storage: Storage, ray_cluster, tmp_path) -> None:
    build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=1000)
    published = {uri: read_stream_rows(uri) for uri in list_streams(storage.root, "photos")}
    add_captions(storage, skip=0, text="another picture")  # new captions: the killed run writes new chunks
    kill_at("mds_shards:chunks:4", KILL_SCRIPT, storage.root, ray_cluster.get_runtime_context().gcs_address)
    assert {uri: read_stream_rows(uri) for uri in list_streams(storage.root, "photos")} == published
    recorded = recorded_units(storage.root, "mds_shards", "photos", prefix="chunk-")
    assert len(recorded) >= 4
    report = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=2)
    chunks = report.units["chunks"]
    assert chunks.skipped == len(recorded) and chunks.ran == chunks.units - len(recorded)
    assert report.units["route"].ran == 0  # every routing unit was recorded before the kill
    assert streams(storage.root) == reference(storage, str(tmp_path / "ref"))
    assert json.loads(Path(report.streams[0].uri, "index.json").read_text())["version"] == 2


def test_drop_leaves_small_streams_unpublished_and_their_rows_rejects(storage: Storage) -> None:
    """`training.small_streams: drop`: a stream below the minimum is not published (a trainer
    listing the folders never meets it), its rows are `small_stream` rejects naming it, not lost;
    the others are exactly what `warn` publishes; lowering the minimum publishes it again."""
    from prx_core.shards.manifest import load_manifest
    from prx_core.stages.mds_shards.index import SMALL_STREAM

    everything = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=1000)
    sizes = {s.name: s.samples for s in everything.streams}
    minimum = sorted(set(sizes.values()))[-1]  # every stream but the largest is below it
    assert len(sizes) >= 2 and sum(n < minimum for n in sizes.values()) >= 1
    before = streams(storage.root)
    report = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=1000, min_stream_samples=minimum)
    kept = {s.name for s in report.streams}
    assert kept == {name for name, n in sizes.items() if n >= minimum}
    assert report.dropped == {name: n for name, n in sizes.items() if n < minimum}
    assert streams(storage.root) == {k: v for k, v in before.items() if k.split("/", 3)[-1] in kept}
    rejected = lance_io.read_table(storage.lance_uri("rejects"), filter=rejects_predicate("photos", "mds_shards"))
    small = [r for r in rejected.to_pylist() if r["reason"] == SMALL_STREAM]
    assert len(small) == sum(report.dropped.values()) == report.rejects[SMALL_STREAM]
    assert all(f"fewer than one global batch x canonical nodes ({minimum})" in r["message"] for r in small)
    index = lance_io.read_table(storage.lance_uri("mds_index"), filter=source_predicate("photos"))
    assert index.num_rows == report.written == sum(s.samples for s in report.streams)
    tiers = {int(name.split("/")[0]) for name in sizes}
    manifests = [load_manifest(storage.root, t) for t in tiers]
    listed = {f"{p.tier}/{p.width}x{p.height}" for m in manifests for p in m.plans()}
    refused = {name.split("/", 1)[1] for m in manifests for name in m.refused}  # no skip_lists run yet
    assert listed | refused == kept  # the manifest knows only what is published
    again = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=1000)  # back to warn
    assert {s.name for s in again.streams} == set(sizes) and streams(storage.root) == before
