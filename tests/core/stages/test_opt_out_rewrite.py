"""`opt-out` and `rewrite-stream` on a real small corpus: MDS streams written by the `mds_shards`
stage on a local Ray (several chunks per stream), skip-lists by the `skip_lists` stage, read back
with mosaicml-streaming and the training loader; Lance rows read with pylance; bytes searched for
in the files on disk. The corpus is built once per module and copied per test."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_mds_stage import CAPTIONER, add_captions
from test_row_stages import make_samples

from prx_core.shards.loader import CorpusDataset
from prx_core.shards.mds.read import read_stream_rows
from prx_core.shards.mds.rewrite import remap_lists
from prx_core.shards.mds.streams import list_streams
from prx_core.shards.skiplists.files import read_skip_lists
from prx_core.shards.skiplists.records import UnfilteredStream
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.opt_out.apply import opt_out
from prx_core.stages.rewrite_streams import parse_stream, rewrite_skipped, skip_fraction, streams_over
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store import lance_io, schemas
from prx_core.store.locks import PartitionLocked, partition_lock
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
LABELER = "lab-v1"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    storage = Storage(str(tmp_path_factory.mktemp("ops") / "corpus"))
    make_samples(storage, "photos", 40, 3)
    add_captions(storage, skip=0)
    build_mds("photos", storage, CAPTIONER, route_rows=7, chunk_rows=3)
    index = lance_io.read_table(storage.lance_uri("mds_index")).sort_by("sample_id").to_pylist()
    labels = [{"content_id": r["content_id"], "captioner_version": CAPTIONER, "labeler_version": LABELER,
               "labeler_id": "t", "label": ("text", "visual", "visual", "visual", "visual")[i % 5], "score": 1.0}
              for i, r in enumerate(index)]
    lance_io.upsert(storage.lance_uri("caption_labels"), pa.Table.from_pylist(labels, schema=schemas.CAPTION_LABELS),
                    ["content_id", "captioner_version", "labeler_version"])
    losers = [{"sample_id": r["sample_id"], "source": "photos", "group_id": "g", "group_size": 2, "keeper": i % 7 != 3,
               "keeper_sample_id": "x", "pixels": 1} for i, r in enumerate(index)]
    lance_io.overwrite(storage.lance_uri("duplicates"), pa.Table.from_pylist(losers, schema=schemas.DUPLICATES))
    build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy())
    return Path(storage.root)


@pytest.fixture()
def storage(base: Path, tmp_path: Path) -> Storage:
    shutil.copytree(base, tmp_path / "corpus")
    return Storage(str(tmp_path / "corpus"))


def streams(storage: Storage) -> dict[str, list[str]]:
    """<source>/<tier>/<w>x<h> -> its sample ids in stream order, read back with streaming."""
    out = {}
    for uri in list_streams(storage.root, "photos"):
        name = "/".join(uri.rstrip("/").rsplit("/", 3)[-3:])
        out[name] = [r["sample_id"] for r in read_stream_rows(uri, ["sample_id"])]
    return out


def loaded(storage: Storage) -> list[str]:
    """Every sample id one epoch of the training loader yields, over every tier."""
    ids = []
    for tier in sorted({int(name.split("/")[1]) for name in streams(storage)}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dataset = CorpusDataset(storage.root, tier, batch_size=1, shuffle=False)
        ids += [s["sample_id"] for s in dataset]
        del dataset
    return ids


def lists_by_id(storage: Storage) -> dict[tuple[str, str], set[str]]:
    return {(s.stream, s.reason): set(s.sample_ids) for s in read_skip_lists(storage.root, "photos")}


def ids_file(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "ids.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def kept_ids(storage: Storage, count: int) -> list[str]:
    """`count` stored ids no skip-list holds, spread over the streams."""
    skipped = {i for ids in lists_by_id(storage).values() for i in ids}
    every = [i for ids in streams(storage).values() for i in ids if i not in skipped]
    return every[:: max(1, len(every) // count)][:count]


def test_opt_out_skips_the_ids_for_the_loader_and_keeps_every_other_list(storage: Storage, tmp_path: Path) -> None:
    before = lists_by_id(storage)
    chosen = kept_ids(storage, 5)
    lines = [*chosen, chosen[0], "photos/no-such-key", "not an id", "elsewhere/k001", "# a comment", ""]
    for buckets, batch_ids in ((8, 2), (1, 1_000_000)):  # spooled 2 at a time into 8 hash buckets, then at once
        report = opt_out(storage, ids_file(tmp_path, lines), ["photos"], batch_ids=batch_ids, buckets=buckets)
        assert (report.read, report.matched, report.in_streams, report.malformed) == (9, 5, 5, 1)
        assert report.unknown == 2 and "photos/no-such-key" in report.examples and "not an id" in report.examples
        after = lists_by_id(storage)
        assert {i for (_, r), ids in after.items() if r == "opt_out" for i in ids} == set(chosen)
        assert {k: v for k, v in after.items() if k[1] != "opt_out"} == before  # the other lists are untouched
    order = streams(storage)
    for skip in read_skip_lists(storage.root, "photos"):  # each position is its id's position in the stream
        assert [order[skip.stream][i] for i in skip.indices] == list(skip.sample_ids)
    read = loaded(storage)
    assert read and not set(read) & set(chosen)
    assert Path(report.record).is_file()
    matched = sorted(Path(storage.root, "_state", "opt_out", "photos").glob("*.ids.parquet"))
    assert matched and set(pq.read_table(matched[-1])["sample_id"].to_pylist()) == set(chosen)


def test_a_later_skip_lists_run_applies_the_recorded_opt_outs(storage: Storage, tmp_path: Path) -> None:
    """skip_lists recomputes every list from the policy; the ids `opt-out` recorded stay skipped,
    and removing the record withdraws them at the next run."""
    chosen = kept_ids(storage, 4)
    opt_out(storage, ids_file(tmp_path, chosen), ["photos"])
    build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy())
    opted = {i for (_, r), ids in lists_by_id(storage).items() if r == "opt_out" for i in ids}
    assert opted == set(chosen) and not set(loaded(storage)) & set(chosen)
    for record in Path(storage.root, "_state", "opt_out", "photos").glob("*.ids.parquet"):
        record.unlink()
    build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy())
    assert not [s for s in read_skip_lists(storage.root, "photos") if s.reason == "opt_out"]


def test_opt_out_refuses_a_stream_whose_skip_lists_are_stale(storage: Storage, tmp_path: Path) -> None:
    chosen = kept_ids(storage, 3)
    for record in Path(storage.root, "skiplists").rglob("_complete.json"):
        record.unlink()
    with pytest.raises(UnfilteredStream, match="materialize skip_lists"):
        opt_out(storage, ids_file(tmp_path, chosen), ["photos"])
    assert not [s for s in read_skip_lists(storage.root, "photos") if s.reason == "opt_out"]


def test_opt_out_waits_for_no_writer(storage: Storage, tmp_path: Path) -> None:
    with partition_lock(storage, "skip_lists", "photos"):
        with pytest.raises(PartitionLocked, match="skip_lists"):
            opt_out(storage, ids_file(tmp_path, kept_ids(storage, 2)), ["photos"])


def files_holding(base: Path, needles: list[bytes]) -> set[bytes]:
    """The needles found in any file under `base`."""
    found = set()
    for path in base.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found |= {n for n in needles if n in data}
    return found


def test_delete_bytes_removes_rows_and_stored_images_and_purge_the_old_bytes(storage: Storage, tmp_path: Path) -> None:
    before = streams(storage)
    skipped_before = lists_by_id(storage)
    chosen = kept_ids(storage, 4) + [next(iter(skipped_before[min(skipped_before)]))]  # one already skipped
    rows = lance_io.read_table(storage.lance_uri("samples"), ["sample_id", "image"], source_predicate("photos"))
    source_bytes = [r["image"] for r in rows.to_pylist() if r["sample_id"] in chosen]
    stored = {}
    for uri in list_streams(storage.root, "photos"):
        for row in read_stream_rows(uri, ["sample_id", "image"]):
            stored[row["sample_id"]] = row["image"]
    stored_bytes = [stored[i] for i in chosen]
    report = opt_out(storage, ids_file(tmp_path, chosen), ["photos"], delete_bytes=True)
    assert report.matched == 5 and report.deleted_rows["samples"] == 5
    assert not set(lance_io.read_table(storage.lance_uri("samples"), ["sample_id"])["sample_id"].to_pylist()) & set(chosen)
    after = streams(storage)
    assert {k: [i for i in v if i not in chosen] for k, v in before.items()} == {k: v for k, v in after.items()}
    assert len(report.streams) == len({k for k, v in before.items() if set(v) & set(chosen)})
    index = lance_io.read_table(storage.lance_uri("mds_index"), filter=source_predicate("photos")).to_pylist()
    assert sorted((f"photos/{r['tier']}/{r['bucket']}", r["index"], r["sample_id"]) for r in index) == sorted(
        (name, i, sid) for name, ids in after.items() for i, sid in enumerate(ids))
    for skip in read_skip_lists(storage.root, "photos"):  # the lists follow the new positions
        assert [after[skip.stream][i] for i in skip.indices] == list(skip.sample_ids)
        assert set(skip.sample_ids) == skipped_before[(skip.stream, skip.reason)] - set(chosen)
    read = loaded(storage)
    assert read and not set(read) & set(chosen)
    mds, lance_dir = Path(storage.root, "mds"), Path(storage.root, "lance", "samples.lance")
    assert files_holding(mds, stored_bytes) == set(stored_bytes)  # superseded chunks: kept for a retention
    assert files_holding(lance_dir, source_bytes)  # deletion vectors: the data files still hold the bytes
    again = opt_out(storage, ids_file(tmp_path, chosen), ["photos"], delete_bytes=True)
    assert again.matched == 0 and again.unknown == 5 and not again.streams  # already gone: nothing to do


def test_purge_removes_the_old_bytes_from_disk(storage: Storage, tmp_path: Path) -> None:
    chosen = kept_ids(storage, 3)
    rows = lance_io.read_table(storage.lance_uri("samples"), ["sample_id", "image"], source_predicate("photos"))
    source_bytes = [r["image"] for r in rows.to_pylist() if r["sample_id"] in chosen]
    stored = [r["image"] for uri in list_streams(storage.root, "photos")
              for r in read_stream_rows(uri, ["sample_id", "image"]) if r["sample_id"] in chosen]
    contents = content_ids(storage, chosen)
    report = opt_out(storage, ids_file(tmp_path, chosen), ["photos"], delete_bytes=True, purge=True)
    assert report.matched == 3 and report.purge.chunks and report.purge.versions["samples"] > 0
    assert report.purge.complete and report.purge.content_rows == {"captions": 3, "caption_labels": 3}
    assert not files_holding(Path(storage.root, "mds"), stored)
    assert not files_holding(Path(storage.root, "lance"), source_bytes)
    assert not files_holding(Path(storage.root, "lance"), [c.encode() for c in contents])  # captions, indexes too
    assert not ids_in_lance(storage, chosen)  # no index segment or old version keeps an id
    assert lance_io.read_table(storage.lance_uri("samples"), ["sample_id"]).num_rows == rows.num_rows - 3
    assert not set(loaded(storage)) & set(chosen)


def content_ids(storage: Storage, ids: list[str]) -> list[str]:
    rows = lance_io.read_table(storage.lance_uri("samples"), ["sample_id", "content_id"]).to_pylist()
    return [r["content_id"] for r in rows if r["sample_id"] in ids]


def test_a_purge_after_the_delete_acts_on_what_the_takedown_recorded(storage: Storage, tmp_path: Path) -> None:
    """The runbook's order: --delete-bytes, then the same with --purge (the ids no longer match)."""
    chosen = kept_ids(storage, 2)
    stored = [r["image"] for uri in list_streams(storage.root, "photos")
              for r in read_stream_rows(uri, ["sample_id", "image"]) if r["sample_id"] in chosen]
    first = opt_out(storage, ids_file(tmp_path, chosen), ["photos"], delete_bytes=True)
    assert first.matched == 2 and files_holding(Path(storage.root, "mds"), stored)
    second = opt_out(storage, ids_file(tmp_path, chosen), ["photos"], delete_bytes=True, purge=True)
    assert (second.matched, second.unknown) == (0, 2)  # before: "purged: 0", the bytes kept 7 days
    assert second.purge.chunks and second.purge.complete
    assert not files_holding(Path(storage.root, "mds"), stored)
    assert not ids_in_lance(storage, chosen)


def ids_in_lance(storage: Storage, ids: list[str]) -> set[bytes]:
    """The ids any Lance file holds, but `duplicates`' (ids and pHashes of the last `duplicates`
    run, no bytes: its next run drops them)."""
    tables = [p for p in Path(storage.root, "lance").iterdir() if p.name != "duplicates.lance"]
    return set().union(*(files_holding(t, [i.encode() for i in ids]) for t in tables))


def test_a_version_an_abandoned_attempt_pins_is_named_until_discarded(storage: Storage, tmp_path: Path) -> None:
    """A crashed attempt pins the version that still holds the rows; the takedown says so, and
    discards the source's abandoned attempts when asked (under their locks)."""
    from prx_core.compute.units import Manifest, UnitRun

    chosen = kept_ids(storage, 1)
    samples = lance_io.read_table(storage.lance_uri("samples"), ["sample_id", "image"], source_predicate("photos"))
    source_bytes = [r["image"] for r in samples.to_pylist() if r["sample_id"] in chosen]
    version = lance_io.table_version(storage.lance_uri("samples"))
    attempt = UnitRun.open(storage, Manifest("buckets", "photos", {"samples": version}, "1"))
    name = f"_runs/buckets/photos/{attempt.manifest.digest()}"
    report = opt_out(storage, ids_file(tmp_path, chosen), ["photos"], delete_bytes=True, purge=True)
    assert not report.purge.complete
    assert [p.line() for p in report.purge.pinned] == [f"samples version {version}, pinned by {name}"]
    assert files_holding(Path(storage.root, "lance", "samples.lance"), source_bytes)  # the pinned version holds them
    done = opt_out(storage, ids_file(tmp_path, chosen), ["photos"], delete_bytes=True, purge=True,
                   discard_attempts=True)
    assert done.purge.complete and done.purge.discarded == [name]
    assert not files_holding(Path(storage.root, "lance"), source_bytes)
    assert not Path(storage.root, name).exists()


def test_other_samples_of_the_same_picture_are_listed_and_taken_down_on_request(storage: Storage,
                                                                               tmp_path: Path) -> None:
    """Every sample of the module's corpus is in one duplicate group ("g"): a takedown of one lists
    the others; `with_copies` takes them down too."""
    chosen = kept_ids(storage, 1)
    report = opt_out(storage, ids_file(tmp_path, chosen), ["photos"], delete_bytes=True)
    others = set(lance_io.read_table(storage.lance_uri("duplicates"), ["sample_id"])["sample_id"].to_pylist()) - set(chosen)
    assert set(report.copies) == others and set(report.copies.values()) == {f"duplicate group of {chosen[0]}"}
    again = kept_ids(storage, 1)
    taken = opt_out(storage, ids_file(tmp_path, again), ["photos"], delete_bytes=True, with_copies=True)
    left = lance_io.read_table(storage.lance_uri("samples"), ["sample_id"], source_predicate("photos"))
    assert set(taken.copies) and not set(taken.copies) & set(left["sample_id"].to_pylist())


def test_rewrite_stream_drops_the_skipped_samples_and_the_loader_yields_the_same(storage: Storage) -> None:
    fractions = [skip_fraction(storage, *parse_stream(name)) for name in streams(storage)]
    worst = max((s for s in fractions if s.fraction < 1), key=lambda s: s.fraction)
    assert worst.fraction > 0.10 and worst.name in {s.name for s in streams_over(storage, 0.10)}
    before_ids = streams(storage)[worst.name]
    skipped = {i for (stream, _), ids in lists_by_id(storage).items() if stream == worst.name for i in ids}
    yielded = set(loaded(storage))
    done = rewrite_skipped(storage, worst.source, worst.key)
    assert (done.before, done.after) == (len(before_ids), len(before_ids) - len(skipped))
    assert streams(storage)[worst.name] == [i for i in before_ids if i not in skipped]
    now = skip_fraction(storage, worst.source, worst.key)
    assert now.skipped == 0 and now.fraction == 0 and worst.name not in {s.name for s in streams_over(storage, 0.10)}
    assert not [s for s in read_skip_lists(storage.root, "photos") if s.stream == worst.name]
    after = loaded(storage)
    assert set(after) == yielded
    assert len([i for i in after if i in set(streams(storage)[worst.name])]) == done.after  # each once per epoch


def test_rewriting_a_fully_skipped_stream_unpublishes_it(storage: Storage, tmp_path: Path) -> None:
    name, ids = min(streams(storage).items(), key=lambda item: len(item[1]))
    opt_out(storage, ids_file(tmp_path, ids), ["photos"])
    assert skip_fraction(storage, *parse_stream(name)).fraction == 1
    done = rewrite_skipped(storage, *parse_stream(name))
    assert done.unpublished and done.after == 0 and name not in streams(storage)
    assert not Path(storage.root, "skiplists", name).exists()
    index = lance_io.read_table(storage.lance_uri("mds_index"), filter=source_predicate("photos")).to_pylist()
    assert not {r["sample_id"] for r in index} & set(ids) and index
    assert loaded(storage)


def test_remap_lists_moves_positions_down_past_the_dropped_ones() -> None:
    lists = {"text": (np.array([1, 4, 6, 9], np.int64), pa.array(["b", "e", "g", "j"])),
             "nsfw": (np.array([3], np.int64), pa.array(["d"]))}
    out = remap_lists(lists, np.array([3, 4, 8], np.int64))
    assert out["text"][0].tolist() == [1, 4, 6] and out["text"][1].to_pylist() == ["b", "g", "j"]
    assert "nsfw" not in out  # all its samples dropped


def test_a_stream_path_names_its_stream() -> None:
    assert parse_stream("/c/mds/photos/512/512x512/") == ("photos", (512, 512, 512))
    with pytest.raises(ValueError, match="expected <source>/<tier>/<w>x<h>"):
        parse_stream("photos/512")
    with pytest.raises(ValueError):
        parse_stream("../512/512x512")

