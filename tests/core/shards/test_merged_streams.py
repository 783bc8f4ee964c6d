"""`training.small_streams: merge`, through the real stages on a real local Ray: two sources' small
streams joined into `mds/_merged/<tier>/<w>x<h>`, read by stock mosaicml-streaming as PRX's trainer
lists a source (`<root>/mds/<source>/<tier>`, each subfolder with index.json a stream), their
skip-lists offset into the merged stream's, the loader refusing it while a member's lists are
missing, a member leaving, and retention keeping what the merged index references."""

from __future__ import annotations

import gc
import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from streaming import Stream, StreamingDataset
from test_mds_stage import CAPTIONER, add_captions
from test_row_stages import make_samples

from prx_core.shards.loader import CorpusDataset
from prx_core.shards.manifest import load_manifest
from prx_core.shards.mds.retention import prune_streams
from prx_core.shards.skiplists.files import read_skip_lists
from prx_core.shards.skiplists.records import UnfilteredStream
from prx_core.sources.catalog import CatalogError, parse_catalog
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.opt_out.apply import opt_out
from prx_core.stages.rewrite_streams import streams_over
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
LABELER = "lab-v1"
SOURCES = ("other", "photos")  # members join a merged stream in source order
UNITS = {"route_rows": 7, "chunk_rows": 4}


@pytest.fixture()
def storage(tmp_path: Path) -> Storage:
    storage = Storage(str(tmp_path / "corpus"))
    make_samples(storage, "other", 12, 1)
    make_samples(storage, "photos", 40, 3)
    add_captions(storage, skip=0)
    return storage


def label_and_dedupe(storage: Storage) -> None:
    """Labels and losers for every sample `mds_index` holds, so each stream skips something."""
    index = lance_io.read_table(storage.lance_uri("mds_index")).sort_by("sample_id").to_pylist()
    labels = [{"content_id": r["content_id"], "captioner_version": CAPTIONER, "labeler_version": LABELER,
               "labeler_id": "t", "label": ("visual", "nsfw", "visual")[i % 3], "score": 1.0}
              for i, r in enumerate(index)]
    lance_io.upsert(storage.lance_uri("caption_labels"), pa.Table.from_pylist(labels, schema=schemas.CAPTION_LABELS),
                    ["content_id", "captioner_version", "labeler_version"])
    losers = [{"sample_id": r["sample_id"], "source": r["sample_id"].split("/")[0], "group_id": "g", "group_size": 2,
               "keeper": i % 4 != 0, "keeper_sample_id": "x", "pixels": 1} for i, r in enumerate(index)]
    lance_io.overwrite(storage.lance_uri("duplicates"), pa.Table.from_pylist(losers, schema=schemas.DUPLICATES))


def prx_listing(root: str, source: str, tier: int) -> list[Path]:
    """The streams PRX's StreamingProcessedDataset finds for a source: subfolders with index.json."""
    folder = Path(root, "mds", source, str(tier))
    return sorted(p for p in folder.iterdir() if (p / "index.json").is_file()) if folder.is_dir() else []


def read_stream(path: Path) -> list[tuple[str, str]]:
    """(sample_id, sha256 of the stored JPEG) in order, by stock streaming."""
    dataset = StreamingDataset(streams=[Stream(local=str(path))], batch_size=1, shuffle=False)
    rows = [(s["sample_id"], hashlib.sha256(s["image"].fp.getvalue()).hexdigest()) for s in dataset]
    del dataset
    gc.collect()
    return rows


def test_small_streams_merge_across_sources(storage: Storage) -> None:
    warned = {s: build_mds(s, storage, CAPTIONER, **UNITS) for s in SOURCES}
    sizes = {(s, r.name): r.samples for s, w in warned.items() for r in w.streams}
    alone = {f"/mds/{s}/512/{p.name}": read_stream(p) for s in SOURCES for p in prx_listing(storage.root, s, 512)}
    minimum = max(sizes.values())  # every stream but the largest is small
    small = {key for key, n in sizes.items() if n < minimum}
    shared = {name for _, name in small if {(s, name) for s in SOURCES} <= small and name.startswith("512/")}
    assert shared and any(n >= minimum for n in sizes.values())

    reports = {s: build_mds(s, storage, CAPTIONER, min_stream_samples=minimum, merge_small=True, **UNITS)
               for s in SOURCES}
    for source, report in reports.items():
        assert report.merged == {name: n for (s, name), n in sizes.items() if s == source and n < minimum}
        assert report.dropped == {} and "small_stream" not in report.rejects
        assert {r.name for r in report.streams if r.merged} == set(report.merged)
        listed = {f"{t}/{p.name}" for t in (512,) for p in prx_listing(storage.root, source, t)}
        assert listed == {name for (s, name), n in sizes.items() if s == source and n >= minimum and name.startswith("512/")}
    # the merged streams, read as a trainer reads a source: members in source order, the same bytes
    merged = {p.name: read_stream(p) for p in prx_listing(storage.root, "_merged", 512)}
    assert set(merged) == {name.split("/")[1] for _, name in small if name.startswith("512/")}
    for bucket, rows in merged.items():
        expected = [row for s in SOURCES for row in alone.get(f"/mds/{s}/512/{bucket}", []) if (s, f"512/{bucket}") in small]
        assert rows == expected
    index = lance_io.read_table(storage.lance_uri("mds_index")).to_pylist()
    assert len(index) == sum(sizes.values())  # positions within each member, as before

    # the merged stream waits for every member's lists, and says which
    label_and_dedupe(storage)
    policy = SkipPolicy()
    build_skip_lists("photos", storage, CAPTIONER, LABELER, policy)
    refused = load_manifest(storage.root, 512).refused
    assert any(name.startswith("_merged/512/") and "member other/512/" in why for name, why in refused.items()), refused
    with pytest.raises(UnfilteredStream, match="member other/512/"):
        CorpusDataset(storage.root, 512, sources=["_merged"], batch_size=1, shuffle=False)
    build_skip_lists("other", storage, CAPTIONER, LABELER, policy)
    assert not load_manifest(storage.root, 512).refused

    # its lists are the members' lists, offset by the members before them
    lists = {(s.source, f"{s.tier}/{s.width}x{s.height}", s.reason): list(zip(s.indices, s.sample_ids))
             for s in read_skip_lists(storage.root)}
    for bucket in merged:
        name, offset, expected = f"512/{bucket}", 0, {}
        for source in SOURCES:
            if (source, name) in small:
                for (s, stream, reason), hits in lists.items():
                    if (s, stream) == (source, name):
                        expected.setdefault(reason, []).extend((i + offset, sid) for i, sid in hits)
                offset += sizes[(source, name)]
        got = {reason: hits for (s, stream, reason), hits in lists.items() if (s, stream) == ("_merged", name)}
        assert got == expected and got
    # the streams worth rewriting are found among the members (a merged stream is rewritten through them)
    over = {s.name for s in streams_over(storage, threshold=-1.0)}  # every stream, with its share
    assert {f"{s}/{name}" for s, name in small} <= over and not any(n.startswith("_merged/") for n in over)
    dataset = CorpusDataset(storage.root, 512, sources=["_merged"], batch_size=1, shuffle=False)
    seen = {s["sample_id"] for s in dataset}
    del dataset
    gc.collect()
    skipped = {sid for (s, _, _), hits in lists.items() if s == "_merged" for _, sid in hits}
    assert seen and not seen & skipped and seen <= {sid for rows in merged.values() for sid, _ in rows}

    # opt-outs reach members: skipped in the merged lists, or deleted from the merged stream's bytes
    kept = [(name, sid) for name, rows in sorted(merged.items()) for sid, _ in rows if sid not in skipped]
    other_id = next(sid for _, sid in kept if sid.startswith("other/"))
    bucket, photo_id = next((name, sid) for name, sid in kept if sid.startswith("photos/"))
    (tmp := Path(storage.root).parent / "ids.txt").write_text(f"{other_id}\n")
    opt_out(storage, str(tmp), list(SOURCES))
    assert other_id in {sid for s in read_skip_lists(storage.root, "_merged") if s.reason == "opt_out" for sid in s.sample_ids}
    tmp.write_text(f"{photo_id}\n")
    opt_out(storage, str(tmp), list(SOURCES), delete_bytes=True, purge=True)
    folder = Path(storage.root, "mds", "_merged", "512", bucket)
    after = [sid for sid, _ in read_stream(folder)]
    assert photo_id not in after and len(after) == len(merged[bucket]) - 1
    copies = [p for p in folder.iterdir() if p.name.startswith("photos.")]
    assert all(photo_id not in pq.read_table(p / "prx-chunk.parquet")["sample_id"].to_pylist() for p in copies)
    assert not load_manifest(storage.root, 512).refused

    # a member leaving (back to warn): the merged streams hold the others only; retention keeps them whole
    build_mds("other", storage, CAPTIONER, **UNITS)
    assert {p.name for p in prx_listing(storage.root, "other", 512)} == {
        name.split("/")[1] for (s, name) in sizes if s == "other" and name.startswith("512/")}
    prune_streams(storage.root, retention_seconds=0)
    for name in merged:
        path = Path(storage.root, "mds", "_merged", "512", name)
        rows = read_stream(path) if (path / "index.json").exists() else []
        expected = [row for row in alone.get(f"/mds/photos/512/{name}", []) if ("photos", f"512/{name}") in small]
        assert rows == [row for row in expected if row[0] != photo_id]
    for (source, name) in small - {(s, n) for s, n in small if s == "other"}:
        assert (Path(storage.root, "mds", source, name, "member.json")).is_file()


def test_the_merged_folder_is_no_source_name(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="'_merged' is reserved"):
        parse_catalog({"sources": [{"name": "_merged", "format": "parquet", "uri": str(tmp_path)}]}, tmp_path)
