"""`mds_shards` resumes across a moving corpus (issue 41, item 6), on a real local Ray, real Lance and
real MDS read back by mosaicml-streaming.

A crash, then another source ingests and appends to `captions` (both shared tables move), then the
rerun: it resumes the crashed attempt (the moved versions are volatile: what the partition reads of
them is pinned instead), redoes at most the unit in flight, and publishes the bytes an uncrashed run
publishes. Whatever phase the crash hit, the published streams stay readable; a crash right after
publishing, followed by a rerun that starts over, never leaves an index.json naming a missing chunk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest
import streaming
from crash import kill_at, recorded_units
from streaming.base.util import clean_stale_shared_memory
from test_mds_stage import CAPTIONER, add_captions
from test_row_stages import make_samples

from prx_core.compute.units import RUNS
from prx_core.shards.mds.retention import prune_streams, referenced_chunks
from prx_core.shards.mds.streams import list_streams
from prx_core.shards.mds.verify import verify_streams
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")

KILL_SCRIPT = """
import ray, sys
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.store.storage import Storage
from prx_core.compute.quiet import start_ray
start_ray(sys.argv[2], log_to_driver=False)
build_mds("photos", Storage(sys.argv[1]), "cap-v1", route_rows=5, chunk_rows=int(sys.argv[3]))
"""


def corpus(root: Path) -> Storage:
    """Two sources, `photos` captioned (one content left without), as test_mds_stage's fixture."""
    storage = Storage(str(root))
    make_samples(storage, "other", 4, 1)
    make_samples(storage, "photos", 40, 3)
    add_captions(storage)
    return storage


def another_source_arrives(storage: Storage) -> None:
    """Source `late` ingests and its contents without a caption are captioned (as its `captions` run
    would: a content shared with `photos` keeps its caption): `samples` and `captions` both move, and
    nothing `photos` reads of them changes."""
    make_samples(storage, "late", 46, 1)  # its first 40 images are photos' own, 6 are new
    late = lance_io.read_table(storage.lance_uri("samples"), ["content_id"], filter=source_predicate("late"))
    captioned = set(lance_io.read_table(storage.lance_uri("captions"), ["content_id"])["content_id"].to_pylist())
    new = sorted(set(late["content_id"].to_pylist()) - captioned)
    assert len(new) >= 6
    rows = [{"content_id": c, "captioner_version": CAPTIONER, "captioner_id": "source", "prompt_version": "p",
             "caption": f"late {c[:8]}", "word_count": 2, "error": ""} for c in new]
    lance_io.upsert(storage.lance_uri("captions"), pa.Table.from_pylist(rows, schema=schemas.CAPTIONS),
                    ["content_id", "captioner_version"])


def published(root: str) -> dict[str, bytes]:
    """Every file a reader of `photos` can reach: each stream's index.json and the chunks it names."""
    files = {}
    for uri in list_streams(root, "photos"):
        stream = Path(uri)
        chunks = referenced_chunks(fsspec.filesystem("file"), uri)
        files[str(stream.relative_to(root)) + "/index.json"] = (stream / "index.json").read_bytes()
        for chunk in sorted(chunks):
            assert (stream / chunk / "index.json").is_file(), f"{uri} names a missing chunk {chunk}"
            files.update({str(p.relative_to(root)): p.read_bytes() for p in (stream / chunk).rglob("*") if p.is_file()})
    return files


def load_with_streaming(root: str, cache: Path) -> dict[str, list[str]]:
    """Each published stream of `photos` opened by mosaicml-streaming, every sample read: ids in order."""
    read = {}
    for n, uri in enumerate(list_streams(root, "photos")):
        clean_stale_shared_memory()
        dataset = streaming.StreamingDataset(remote=uri, local=str(cache / f"{n}-{hashlib.sha1(uri.encode()).hexdigest()[:8]}"),
                                             shuffle=False, batch_size=1)
        read[uri[len(root):]] = [dataset[i]["sample_id"] for i in range(dataset.num_samples)]
        del dataset
    return read


def started_units(root: str, prefix: str) -> set[str]:
    (attempt,) = Path(root, RUNS, "mds_shards", "photos").iterdir()
    return {p.name for p in (attempt / "started").glob(f"{prefix}*")}


@pytest.mark.parametrize("point,phase", [("mds_shards:route:2", "route"), ("mds_shards:chunks:4", "chunks"),
                                         ("mds_shards:index:1", "index")])
def test_a_crashed_run_resumes_after_another_source_moves_the_shared_tables(tmp_path: Path, ray_cluster, point: str,
                                                                            phase: str) -> None:
    storage = corpus(tmp_path / "corpus")
    build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=1000)
    before = load_with_streaming(storage.root, tmp_path / "cache-before")
    add_captions(storage, skip=0, text="another picture")  # new captions: the killed run writes new chunks
    kill_at(point, KILL_SCRIPT, storage.root, ray_cluster.get_runtime_context().gcs_address, "2")
    crashed = load_with_streaming(storage.root, tmp_path / "cache-crash")  # readable, whole
    assert crashed == before or phase == "index"  # killed after its publish: the new streams
    prefix = {"route": "route-", "chunks": "chunk-", "index": "index-"}[phase]
    recorded = recorded_units(storage.root, "mds_shards", "photos", prefix=prefix)
    begun = started_units(storage.root, prefix)
    versions = {t: lance_io.table_version(storage.lance_uri(t)) for t in ("samples", "captions")}
    another_source_arrives(storage)
    assert all(lance_io.table_version(storage.lance_uri(t)) > v for t, v in versions.items())

    report = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=2)
    units = report.units[phase]
    redone = begun - set(recorded)  # begun before the crash, not recorded: run again
    print(f"{phase}: {units.units} units, {units.skipped} skipped, {units.ran} ran, {len(redone)} redone")
    assert units.skipped == len(recorded) > 0 and units.ran == units.units - len(recorded)
    assert len(redone) <= 1  # at most one unit per worker (the ray_cluster has one CPU)
    for earlier in ("route", "chunks", "index")[:("route", "chunks", "index").index(phase)]:
        assert report.units[earlier].ran == 0  # finished phases are not run again
    assert report.read_versions["captions"] == versions["captions"]  # the versions the attempt pinned
    after = load_with_streaming(storage.root, tmp_path / "cache-after")
    assert crashed == after or phase != "index"

    clean = corpus(tmp_path / "clean")  # an uncrashed run over the same content
    add_captions(clean, skip=0, text="another picture")
    another_source_arrives(clean)
    build_mds("photos", clean, CAPTIONER, route_rows=5, chunk_rows=2)
    mine, theirs = published(storage.root), published(clean.root)
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        assert mine[name] == theirs[name], (name, mine[name][:3000], theirs[name][:3000])  # byte for byte
    assert after == load_with_streaming(clean.root, tmp_path / "cache-clean")
    assert not list(Path(storage.root, RUNS, "mds_shards", "photos").iterdir())


def test_a_crash_after_publish_never_leaves_an_index_naming_a_missing_chunk(tmp_path: Path, ray_cluster) -> None:
    storage = corpus(tmp_path / "corpus")
    address = ray_cluster.get_runtime_context().gcs_address
    kill_at("mds_shards:index:1", KILL_SCRIPT, storage.root, address, "2")  # published, then killed
    streams = published(storage.root)  # every chunk the new index names is there
    assert streams and load_with_streaming(storage.root, tmp_path / "cache-crash")
    # a rerun that starts over (other chunk sizes: another attempt) discards the crashed attempt; the
    # chunks the live index names stay until an index without them is published
    kill_at("mds_shards:route:1", KILL_SCRIPT, storage.root, address, "3")
    assert published(storage.root) == streams
    load_with_streaming(storage.root, tmp_path / "cache-opened")
    report = build_mds("photos", storage, CAPTIONER, route_rows=5, chunk_rows=3)
    assert verify_streams([s.uri for s in report.streams]).ok
    load_with_streaming(storage.root, tmp_path / "cache-after")
    superseded = {json.loads(Path(s.uri, "superseded.json").read_text())["version"] for s in report.streams
                  if Path(s.uri, "superseded.json").exists()}
    assert superseded == {1}  # the spared chunks are recorded as dropped by the new index
    pruned = prune_streams(storage.root, retention_seconds=0)  # their removal is retention's
    assert pruned.removed and published(storage.root) and verify_streams([s.uri for s in report.streams]).ok
