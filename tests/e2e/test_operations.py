"""The runbooks of docs/operations.md, command by command, on ONE small corpus built once per module:
opting samples out, adding a source (over a crashed writer's stale lock, the opt-outs applied again
after `skip_lists`), a takedown that deletes the bytes and stays down through a re-ingest, and
rewriting streams past 10% skipped. Each step
runs the real `prx-corpus` console script; what it left is read back with pylance, the training
loader (`CorpusDataset`) and the files on disk. Two builds of two image folders (6 and 4 real
photos, two byte copies across them) and one `skip_lists` run: ~3 min on this 2-core machine
(5 min under a load of 12).
The tests run in file order, each on what the previous left, as an operator would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import lance
import pytest
from PIL import Image
from test_build import build_args, hash_tree, run_cli

from prx_core.demo.photos import load_skimage_photos

pytestmark = pytest.mark.slow


@dataclass
class Corpus:
    work: Path
    root: Path
    home: Path
    one: Path  # the catalog with photos_a only
    two: Path  # photos_a and photos_b
    mds_a: dict[str, str]  # photos_a's MDS files after the first build
    victim: str = ""  # the sample the takedown removed
    victim_bytes: list[bytes] = field(default_factory=list)  # its stored JPEG and its source bytes


def write_folder(folder: Path, photos: list, copies: dict[str, Path] | None = None) -> None:
    folder.mkdir(parents=True)
    for photo in photos:
        photo.image.convert("RGB").resize((512, 512), Image.Resampling.BICUBIC).save(folder / f"{photo.name}.jpg",
                                                                                      quality=90)
        (folder / f"{photo.name}.txt").write_text(photo.caption)
    for name, path in (copies or {}).items():  # byte copies: duplicates across sources
        (folder / f"{name}.jpg").write_bytes(path.read_bytes())
        (folder / f"{name}.txt").write_text(path.with_suffix(".txt").read_text())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    work = tmp_path_factory.mktemp("ops")
    photos = load_skimage_photos()[:10]
    write_folder(work / "a", photos[:6])
    write_folder(work / "b", photos[6:10], {"copy_0": work / "a" / f"{photos[0].name}.jpg",
                                            "copy_1": work / "a" / f"{photos[1].name}.jpg"})
    one, two = work / "one.yaml", work / "two.yaml"
    one.write_text(f"sources:\n- {{name: photos_a, format: imagefolder, uri: {work / 'a'}}}\n")
    two.write_text(one.read_text() + f"- {{name: photos_b, format: imagefolder, uri: {work / 'b'}}}\n")
    root, home = work / "corpus", work / "dagster"
    first = run_cli(*build_args(one, root, home))
    assert first.returncode == 0, first.explain()
    return Corpus(work, root, home, one, two, hash_tree(root / "mds" / "photos_a"))


def loaded(root: Path) -> list[str]:
    """The sample ids one epoch of the training loader yields, every tier, every source."""
    from prx_core.shards.loader import CorpusDataset

    ids = []
    for tier in sorted({int(p.parent.parent.name) for p in (root / "mds").glob("*/*/*/index.json")}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dataset = CorpusDataset(str(root), tier, batch_size=1, shuffle=False)
        ids += [s["sample_id"] for s in dataset]
        del dataset
    return ids


def stream_ids(root: Path) -> dict[str, list[str]]:
    """<source>/<tier>/<w>x<h> -> its sample ids in stream order, read with mosaicml-streaming."""
    from prx_core.shards.mds.read import read_stream_rows

    return {"/".join(p.parent.parts[-3:]): [r["sample_id"] for r in read_stream_rows(str(p.parent), ["sample_id"])]
            for p in sorted((root / "mds").glob("*/*/*/index.json"))}


def skipped(root: Path, reason: str | None = None) -> set[str]:
    from prx_core.shards.skiplists.files import read_skip_lists

    return {i for s in read_skip_lists(str(root)) if reason in (None, s.reason) for i in s.sample_ids}


def write_ids(corpus: Corpus, name: str, ids: list[str]) -> Path:
    path = corpus.work / name
    path.write_text("\n".join(ids) + "\n")
    return path


def test_opting_samples_out(corpus: Corpus) -> None:
    kept = [i for i in stream_ids(corpus.root)["photos_a/512/512x512"] if i not in skipped(corpus.root)][:2]
    ids = write_ids(corpus, "optout.txt", [*kept, "photos_a/never_seen", "nowhere/x"])
    done = run_cli("opt-out", "--ids", str(ids), "--root", str(corpus.root), "--sources", str(corpus.one))
    assert done.returncode == 0, done.explain()
    assert "opt-out: 4 ids read, 2 matched (2 in published streams), 2 unknown, 0 malformed" in done.stdout
    assert "photos_a/never_seen" in done.stdout and "skip-lists republished (opt_out): 1 streams" in done.stdout
    assert skipped(corpus.root, "opt_out") == set(kept)
    assert not set(loaded(corpus.root)) & set(kept)


def hold_and_die(root: Path, asset: str, source: str) -> None:
    """A writer that takes a partition lock and is SIGKILLed holding it: a stale `_locks` file."""
    code = ("import os, signal; from prx_core.store.locks import PartitionLock; from prx_core.store.storage "
            f"import Storage; PartitionLock(Storage({str(root)!r}), {asset!r}, {source!r}).acquire(); "
            "print('held', flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PRX_LOCK_TTL_SECONDS": "300"})
    assert done.returncode == -signal.SIGKILL and "held" in done.stdout, done.stderr
    assert (root / "_locks" / asset / f"{source}.lock").exists()


def test_adding_a_source_after_a_crashed_writer(corpus: Corpus) -> None:
    """Runbooks: add the entry, build the new source, then `skip_lists` of every source (duplicates
    are global: the new source can make an old sample a losing copy). A writer of photos_a's
    skip-lists was SIGKILLed before: its lock is taken over at once (same host, process gone). The
    `skip_lists` run recomputes the lists and applies the recorded opt-outs again by itself."""
    opted = skipped(corpus.root, "opt_out")
    hold_and_die(corpus.root, "skip_lists", "photos_a")
    added = run_cli(*build_args(corpus.two, corpus.root, corpus.home, "--source", "photos_b"))
    assert added.returncode == 0, added.explain()
    refiltered = run_cli(*build_args(corpus.two, corpus.root, corpus.home, "--select", "skip_lists"))
    assert refiltered.returncode == 0, refiltered.explain()
    assert not (corpus.root / "_locks" / "skip_lists" / "photos_a.lock").exists()
    assert hash_tree(corpus.root / "mds" / "photos_a") == corpus.mds_a  # the old source's shards untouched
    assert {name.split("/")[0] for name in stream_ids(corpus.root)} == {"photos_a", "photos_b"}
    losers = skipped(corpus.root, "duplicate")
    assert len(losers) == 2 and {i.split("/")[1] for i in losers} <= {"copy_0", "copy_1", "astronaut", "chelsea"}
    assert skipped(corpus.root, "opt_out") == opted  # the recorded opt-outs apply to every later run
    read = loaded(corpus.root)
    assert skipped(corpus.root, "opt_out") == opted and not set(read) & (opted | losers)
    assert {i.split("/")[0] for i in read} == {"photos_a", "photos_b"}


def file_bytes(base: Path, needles: list[bytes]) -> set[bytes]:
    found = set()
    for path in (p for p in base.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found |= {n for n in needles if n in data}
    return found


def test_a_takedown_deletes_the_bytes(corpus: Corpus) -> None:
    from prx_core.shards.mds.read import read_stream_rows

    victim = [i for i in stream_ids(corpus.root)["photos_b/512/512x512"] if i not in skipped(corpus.root)][0]
    stored = [r["image"] for p in (corpus.root / "mds" / "photos_b").glob("*/*/index.json")
              for r in read_stream_rows(str(p.parent), ["sample_id", "image"]) if r["sample_id"] == victim]
    samples = lance.dataset(str(corpus.root / "lance" / "samples.lance"))
    source = samples.to_table(columns=["image"], filter=f"sample_id = '{victim}'")["image"].to_pylist()
    assert stored and source
    ids = write_ids(corpus, "takedown.txt", [victim])
    done = run_cli("opt-out", "--ids", str(ids), "--root", str(corpus.root), "--sources", str(corpus.two),
                   "--delete-bytes", "--purge")
    assert done.returncode == 0, done.explain()
    assert "1 matched" in done.stdout and "deleted rows: samples 1" in done.stdout
    assert "streams republished without them: 1" in done.stdout
    left = lance.dataset(str(corpus.root / "lance" / "samples.lance"))
    assert left.count_rows(f"sample_id = '{victim}'") == 0
    assert not file_bytes(corpus.root / "mds", stored) and not file_bytes(corpus.root / "lance", source)
    assert victim not in loaded(corpus.root)
    corpus.victim, corpus.victim_bytes = victim, stored + source


def test_a_taken_down_id_stays_down_through_a_re_ingest(corpus: Corpus) -> None:
    """The source still holds the image: a forced re-ingest (the runbook's) read it back into
    `samples`, a new MDS chunk and the explorer. It is now a `taken_down` reject, never stored."""
    from prx_core.shards.mds.read import read_stream_rows

    victim = corpus.victim
    done = run_cli(*build_args(corpus.two, corpus.root, corpus.home, "--source", "photos_b", "--rerun", "samples"))
    assert done.returncode == 0, done.explain()
    assert "rerun samples: photos_b will run again" in done.stdout, done.stdout  # unchanged: forced (the runbook's)
    assert "taken down, refused at ingest: 1 (photos_b 1)" in done.stdout, done.stdout
    samples = lance.dataset(str(corpus.root / "lance" / "samples.lance"))
    assert samples.count_rows(f"sample_id = '{victim}'") == 0
    rejects = lance.dataset(str(corpus.root / "lance" / "rejects.lance")).to_table(
        columns=["reason", "message"], filter=f"sample_id = '{victim}'").to_pylist()
    assert [r["reason"] for r in rejects] == ["taken_down"], rejects
    streamed = {r["sample_id"] for p in (corpus.root / "mds" / "photos_b").glob("*/*/index.json")
                for r in read_stream_rows(str(p.parent), ["sample_id"])}
    assert streamed and victim not in streamed
    explorer = lance.dataset(str(corpus.root / "lance" / "explorer.lance"))
    shown = explorer.to_table(columns=["sample_id", "reject_reason"], filter=f"sample_id = '{victim}'").to_pylist()
    assert all(r["reject_reason"] == "taken_down" for r in shown), shown  # listed as refused, never as an image
    assert victim not in loaded(corpus.root)


def test_rewriting_streams_past_ten_percent(corpus: Corpus) -> None:
    from prx_core.stages.rewrite_streams import parse_stream, skip_fraction
    from prx_core.store.storage import Storage

    storage = Storage(str(corpus.root))
    over = {n for n in stream_ids(corpus.root) if skip_fraction(storage, *parse_stream(n)).fraction > 0.10}
    assert over  # the opt-outs (2 of 6) and the losing copies (2 of 4 or 2 of 6)
    before = set(loaded(corpus.root))
    done = run_cli("rewrite-stream", "--root", str(corpus.root), "--over", "0.10")
    assert done.returncode == 0, done.explain()
    assert f"{len(over)} streams skip more than 10%" in done.stdout
    assert all(skip_fraction(storage, *parse_stream(n)).fraction == 0 for n in stream_ids(corpus.root))
    assert not skipped(corpus.root)
    after = loaded(corpus.root)
    assert set(after) == before and len(after) == len(set(after))  # the same samples, each once


def test_republishing_the_manifests_of_a_corpus_written_before_them(corpus: Corpus) -> None:
    import shutil

    from prx_core.shards.loader import CorpusDataset
    from prx_core.shards.manifest import MissingManifest

    before = loaded(corpus.root)
    shutil.rmtree(corpus.root / "manifests")  # what a corpus built by an older release looks like
    with pytest.raises(MissingManifest, match="`prx-corpus manifest`"):
        CorpusDataset(str(corpus.root), 512, batch_size=1)
    done = run_cli("manifest", "--root", str(corpus.root))
    assert done.returncode == 0, done.explain()
    tiers = sorted({int(p.parent.parent.name) for p in (corpus.root / "mds").glob("*/*/*/index.json")})
    assert [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("tier ")] == \
           [f"tier {t}" for t in tiers]
    assert "0 refused" in done.stdout and "refused " not in done.stdout.replace("0 refused", "")
    assert loaded(corpus.root) == before


def test_a_takedown_that_an_abandoned_attempt_pins_is_incomplete_until_discarded(corpus: Corpus) -> None:
    """A crashed attempt pins the version holding the rows: the takedown names it and exits 1;
    `--discard-attempts` finishes it. The same picture in another source is listed, and taken
    down too with `--with-copies`."""
    from prx_core.compute.units import Manifest, UnitRun
    from prx_core.store.storage import Storage

    samples = lance.dataset(str(corpus.root / "lance" / "samples.lance"))
    rows = samples.to_table(columns=["sample_id", "content_id", "image"]).to_pylist()
    victim, copy = [(r, c) for c in rows if c["sample_id"].startswith("photos_b/copy_") for r in rows
                    if r["content_id"] == c["content_id"] and r["sample_id"] != c["sample_id"]][0]
    attempt = UnitRun.open(Storage(str(corpus.root)), Manifest("buckets", "photos_a", {"samples": samples.version}, "x"))
    pinned = f"_runs/buckets/photos_a/{attempt.manifest.digest()}"
    ids = write_ids(corpus, "takedown-pinned.txt", [victim["sample_id"]])
    args = ["opt-out", "--ids", str(ids), "--root", str(corpus.root), "--sources", str(corpus.two), "--delete-bytes",
            "--purge"]
    first = run_cli(*args)
    assert first.returncode == 1, first.explain()
    assert f"{copy['sample_id']}: same content as {victim['sample_id']}" in first.stdout
    assert "NOT taken down (--with-copies takes them down too)" in first.stdout
    assert f"kept samples version {samples.version}, pinned by {pinned}: it still holds the deleted rows" in first.stdout
    assert "takedown incomplete" in first.stderr
    assert file_bytes(corpus.root / "lance" / "samples.lance", [victim["image"]])  # the pinned version holds them

    done = run_cli(*args, "--discard-attempts", "--with-copies")
    assert done.returncode == 0, done.explain()
    assert f"discarded the abandoned attempt {pinned}" in done.stdout and not (corpus.root / pinned).exists()
    left = {r["sample_id"] for r in lance.dataset(str(corpus.root / "lance" / "samples.lance")).to_table(
        columns=["sample_id"]).to_pylist()}
    assert victim["sample_id"] not in left and copy["sample_id"] not in left
    assert not file_bytes(corpus.root / "lance", [victim["image"]])
