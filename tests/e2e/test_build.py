"""`prx-corpus build` end to end on the demo sources, as an operator runs it.

The demo corpus is built ONCE per module (~85 s on this 2-core machine when nothing else runs) and tests 1-5 assert
on it; the rerun (6) then rebuilds it in place, the SIGKILL tests (7, 8, 8b) work on copies of
it, and the failing-check build and the bad invocations (9, 10) run together, apart from it.
Everything compared is read from disk with plain pylance / json / mosaicml-streaming, never
through the pipeline's own readers. Run with -s to see phase timings and the measured 50%-resize
duplicate match rate. At exit, mosaicml-streaming's resource_tracker prints KeyError /
"leaked shared_memory" noise for the datasets it already unlinked: harmless.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pytest
from PIL import Image

from prx_core.stages.unchanged import force_next_run
from prx_core.store.storage import Storage

pytestmark = pytest.mark.slow

CLI = str(Path(sys.executable).with_name("prx-corpus"))
SUMMARY_COLUMNS = ["source", "samples", "rejects", "bucketed", "text", "nsfw", "duplicates", "streams", "in_mds",
                   "skipped"]
MDS_COLUMNS = {"image", "caption", "original_caption", "width", "height", "original_width", "original_height",
               "sample_id", "source"}
TABLES = ("samples", "rejects", "captions", "caption_labels", "caption_embeddings", "source_embeddings", "phashes",
          "duplicates", "buckets", "mds_index")
# unique keys per table (docs/architecture.md): sample_id tables, rejects per stage, content tables per model version
TABLE_KEYS = {
    "samples": ("sample_id",), "phashes": ("sample_id",), "buckets": ("sample_id",), "duplicates": ("sample_id",),
    "mds_index": ("sample_id",), "rejects": ("sample_id", "stage"),
    "captions": ("content_id", "captioner_version"),
    "caption_labels": ("content_id", "captioner_version", "labeler_version"),
    "caption_embeddings": ("content_id", "captioner_version", "embedder_version"),
    "source_embeddings": ("sample_id",),
}
MARKER = "PRX-PAUSED-AT"
RUN_LINE = re.compile(r"^==> (?P<assets>[a-z_, ]+?)(?: \[(?P<partition>[a-z0-9_]+)\])?$")
RESULT_LINE = re.compile(r"^    (?P<status>ok|FAILED) in [0-9.]+ s \(run [0-9a-f]{8}\)$")


# -- running the CLI ------------------------------------------------------------------------------

def cli_env(**extra: str) -> dict[str, str]:
    """The test sandbox's environment (HOME, TMPDIR set by conftest), nothing inherited that
    would point the build elsewhere."""
    env = os.environ.copy()
    for name in ("DAGSTER_HOME", "PRX_ROOT", "PRX_SOURCES", "PRX_CONFIG", "PRX_PAUSE_AT", "RAY_ADDRESS"):
        env.pop(name, None)
    env.update(extra)
    return env


@dataclass
class Run:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def explain(self) -> str:
        return f"prx-corpus {' '.join(self.args)} -> {self.returncode}\n{self.stdout}\n--- stderr (tail) ---\n" \
               + "\n".join(self.stderr.splitlines()[-60:])


def run_cli(*args: str, timeout: float = 900, **env: str) -> Run:
    started = time.monotonic()
    done = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout, env=cli_env(**env),
                          start_new_session=True)
    return Run(list(args), done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def build_args(sources: Path, root: Path, home: Path, *more: str) -> list[str]:
    return ["build", "--sources", str(sources), "--root", str(root), "--dagster-home", str(home), *more]


class Paused:
    """A `prx-corpus build` started in its own session with PRX_PAUSE_AT, output to files."""

    def __init__(self, args: list[str], point: str, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.point, self.args = point, args
        self.out_path, self.err_path = workdir / "paused.stdout", workdir / "paused.stderr"
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        self.proc = subprocess.Popen([CLI, *args], stdout=self._out, stderr=self._err, env=cli_env(PRX_PAUSE_AT=point),
                                     start_new_session=True)

    def text(self) -> str:
        return self.out_path.read_text() + "\n--- stderr (tail) ---\n" + "\n".join(
            self.err_path.read_text().splitlines()[-60:])

    def wait_for_marker(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"{MARKER} {self.point}" in self.err_path.read_text():
                return
            if self.proc.poll() is not None:
                self.close()
                pytest.fail(f"build exited {self.proc.returncode} before reaching {self.point}:\n{self.text()}")
            time.sleep(0.2)
        self.kill()
        pytest.fail(f"no {MARKER} {self.point} within {timeout} s:\n{self.text()}")

    def kill(self) -> list[int]:
        """SIGKILL the whole process group (the CLI, Ray's GCS, raylet and workers); returns the
        ids of processes of this build still alive 30 s later (then killed one by one)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)
        self.close()
        deadline = time.monotonic() + 30
        while (left := self.survivors()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:  # only processes this build started: they carry its PRX_PAUSE_AT
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    def survivors(self) -> list[int]:
        """Processes whose environment holds this build's PRX_PAUSE_AT: its descendants only
        (the pytest process and other engineers' processes never have it)."""
        needle = f"PRX_PAUSE_AT={self.point}".encode()
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as handle:
                    environ = handle.read().split(b"\0")
                with open(f"/proc/{name}/stat") as handle:
                    state = handle.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if needle in environ and state != "Z":
                found.append(int(name))
        return found

    def close(self) -> None:
        for handle in (self._out, self._err):
            if not handle.closed:
                handle.close()


# -- reading what a build left on disk -------------------------------------------------------------

def norm(value: Any) -> Any:
    """A hashable, comparable cell: bytes by their SHA-256, lists as tuples."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "sha256:" + hashlib.sha256(bytes(value)).hexdigest()
    if isinstance(value, list):
        return tuple(norm(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, norm(v)) for k, v in value.items()))
    return value


def table_uri(root: Path, name: str) -> str:
    return str(root / "lance" / f"{name}.lance")


def table_rows(root: Path, name: str, columns: list[str] | None = None) -> list[dict[str, Any]]:
    return lance.dataset(table_uri(root, name)).to_table(columns=columns).to_pylist()


def table_snapshot(root: Path, name: str) -> list[tuple]:
    """Every row of the table, normalized and sorted: equal lists mean equal contents."""
    dataset = lance.dataset(table_uri(root, name))
    names = dataset.schema.names
    return sorted((tuple((c, norm(r[c])) for c in names) for r in dataset.to_table().to_pylist()), key=repr)


def hash_tree(base: Path, skip_dot: bool = True) -> dict[str, str]:
    """relative path -> SHA-256 of every file under `base` (dot folders such as .staging skipped)."""
    out = {}
    if not base.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(base):
        if skip_dot:
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            out[path.relative_to(base).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def published_streams(mds: Path, source: str | None = None) -> list[Path]:
    """The PRX trainer's discovery: for each `<mds>/<source>/<tier>`, every immediate subfolder
    holding index.json is one stream."""
    found = []
    for src in sorted(p for p in mds.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if source is not None and src.name != source:
            continue
        for tier in sorted(p for p in src.iterdir() if p.is_dir()):
            found += [s for s in sorted(tier.iterdir()) if s.is_dir() and (s / "index.json").exists()]
    return found


def index_count(stream: Path) -> int:
    return sum(shard["samples"] for shard in json.loads((stream / "index.json").read_text())["shards"])


def read_skip_files(root: Path) -> list[dict[str, Any]]:
    """Every skip-list as (source, tier, bucket, reason, indices, sample_ids, header), parsed by hand
    from the documented format: magic, u32 header length, JSON header, int64 indices; the sample
    ids from the `.ids.parquet` beside it."""
    import pyarrow.parquet as pq

    out = []
    base = root / "skiplists"
    for path in sorted(base.rglob("*.skip")) if base.exists() else []:
        source, tier, bucket, name = path.relative_to(base).parts
        data = path.read_bytes()
        assert data[:8] == b"PRXSKIP2", path
        length = int.from_bytes(data[8:12], "little")
        header = json.loads(data[12:12 + length])
        ids = pq.read_table(path.with_name(name[:-len(".skip")] + ".ids.parquet")).to_pylist()
        indices = np.frombuffer(data[12 + length:], "<i8").tolist()
        assert [r["index"] for r in ids] == indices, path
        out.append({"source": source, "tier": int(tier), "bucket": bucket, "reason": name[:-len(".skip")],
                    "indices": indices, "sample_ids": [r["sample_id"] for r in ids], "header": header})
    return out


@dataclass
class StreamRead:
    """What mosaicml-streaming returned for one stream folder."""

    source: str
    tier: int
    bucket: str
    by_index: list[dict[str, Any]] = field(default_factory=list)  # ds[offset + i], image summarized


def load_streams(streams: list[Path], rel_to: Path, local_base: Path) -> tuple[dict[str, StreamRead], list[dict]]:
    """Load `streams` exactly as the trainer does (one `Stream(local=...)` per folder, one
    StreamingDataset, batch_size 1, no shuffle), from a private copy under `local_base` (each
    dataset gets its own local dirs). Returns per-stream rows by index and the rows iteration
    yielded; images are decoded and summarized as (size, mode, format)."""
    from streaming import Stream, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    locals_ = []
    for stream in streams:
        copy = local_base / stream.relative_to(rel_to)
        shutil.copytree(stream, copy)
        locals_.append(copy)
    clean_stale_shared_memory()
    dataset = StreamingDataset(streams=[Stream(local=str(p)) for p in locals_], batch_size=1, shuffle=False)
    try:
        def summarize(sample: dict[str, Any]) -> dict[str, Any]:
            image = sample["image"]
            assert isinstance(image, Image.Image), type(image)
            image.load()
            return {**{k: v for k, v in sample.items() if k != "image"},
                    "image": (image.size, image.mode, image.format), "_columns": frozenset(sample)}

        reads: dict[str, StreamRead] = {}
        for i, local in enumerate(locals_):
            rel = local.relative_to(local_base).as_posix()
            source, tier, bucket = rel.split("/")
            read = StreamRead(source, int(tier), bucket)
            offset, count = int(dataset.sample_offset_per_stream[i]), int(dataset.samples_per_stream[i])
            read.by_index = [summarize(dataset[offset + j]) for j in range(count)]
            reads[rel] = read
        iterated = [summarize(sample) for sample in dataset]
    finally:
        del dataset
        clean_stale_shared_memory()
    return reads, iterated


def parse_summary(stdout: str) -> dict[str, dict[str, Any]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == SUMMARY_COLUMNS)
    table = {}
    for line in lines[start + 1:]:
        parts = line.split()
        if len(parts) != len(SUMMARY_COLUMNS) or not all(p.isdigit() for p in parts[1:]):
            break
        table[parts[0]] = {c: int(v) for c, v in zip(SUMMARY_COLUMNS[1:], parts[1:])}
    return table


def run_lines(stdout: str) -> list[tuple[str, str | None, str]]:
    """(assets, partition, status) per progress line pair `==> ...` / `    ok in ...`."""
    lines = stdout.splitlines()
    out = []
    for i, line in enumerate(lines):
        if match := RUN_LINE.match(line):
            result = RESULT_LINE.match(lines[i + 1]) if i + 1 < len(lines) else None
            assert result, f"progress line {line!r} is not followed by a result line: {lines[i + 1:i + 2]}"
            out.append((match["assets"], match["partition"], result["status"]))
    return out


def captions_metadata(home: Path) -> dict[str, list[dict[str, Any]]]:
    """Per partition, the `captions` materializations' metadata (newest first) in the instance."""
    import dagster as dg

    instance = dg.DagsterInstance.from_config(str(home))
    try:
        out = {}
        for partition in sorted(instance.get_dynamic_partitions("sources")) or []:
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("captions"), asset_partitions=[partition]), limit=10).records
            out[partition] = [{k: v.value for k, v in r.asset_materialization.metadata.items()} for r in records]
        return out
    finally:
        instance.dispose()


class Clock:
    """Prints the seconds each phase of a long test took (visible with -s)."""

    def __init__(self, name: str) -> None:
        self.name, self.last = name, time.monotonic()

    def __call__(self, phase: str) -> None:
        now = time.monotonic()
        print(f"\n{self.name}: {phase} after {now - self.last:.1f} s", end="")
        self.last = now


# -- the demo, its manifest and the one build -----------------------------------------------------

def manifest_sample_id(demo: Path, entry: dict[str, Any]) -> str:
    """`<source>/<source_key>`; image-folder keys are paths relative to the folder, no extension."""
    key = entry["key"]
    if entry["source"] == "web_images":
        folder = demo / "web_images"
        [path] = [p for p in folder.rglob(f"{key}.*") if p.suffix != ".txt"]
        key = path.relative_to(folder).with_suffix("").as_posix()
    return f"{entry['source']}/{key}"


@dataclass
class Built:
    demo: Path
    root: Path
    home: Path
    run: Run
    tables: dict[str, list[tuple]]
    mds: dict[str, str]
    skiplists: dict[str, str]
    manifest: list[dict[str, Any]]
    manifests: dict[str, str]  # the tier manifests the loader reads


@pytest.fixture(scope="module")
def built(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Built:
    work = tmp_path_factory.mktemp("e2e-build")
    root, home = work / "corpus", work / "dh"
    result = run_cli(*build_args(demo_dir / "sources.yaml", root, home))
    print(f"\nfirst build: {result.seconds:.0f} s, exit {result.returncode}")
    manifest = json.loads((demo_dir / "manifest.json").read_text())
    for entry in manifest:
        entry["sample_id"] = manifest_sample_id(demo_dir, entry)
    tables = {t: table_snapshot(root, t) for t in TABLES} if result.returncode == 0 else {}
    return Built(demo_dir, root, home, result, tables, hash_tree(root / "mds"), hash_tree(root / "skiplists"), manifest,
                 hash_tree(root / "manifests"))


@pytest.fixture(scope="module")
def ok_build(built: Built) -> Built:
    assert built.run.returncode == 0, built.run.explain()
    return built


@pytest.fixture(scope="module")
def streamed(ok_build: Built, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, StreamRead], list[dict]]:
    mds = ok_build.root / "mds"
    return load_streams(published_streams(mds), mds, tmp_path_factory.mktemp("stream-read") / "mds")


def caption_key_of(root: Path) -> dict[str, str]:
    """sample_id -> its caption's key (the demo's `source` captions are keyed by content and text),
    which caption_labels rows carry as content_id."""
    rows = table_rows(root, "samples", ["sample_id", "content_id", "original_caption"])
    keys = caption_keys(CaptionerConfig("source").version(), [r["content_id"] for r in rows],
                        [r["original_caption"] for r in rows])
    return {r["sample_id"]: key for r, key in zip(rows, keys)}


def labels_of(root: Path) -> dict[str, str]:
    return {r["content_id"]: r["label"] for r in table_rows(root, "caption_labels", ["content_id", "label"])}


# -- 1. exit code, progress, summary --------------------------------------------------------------

def test_build_succeeds_with_progress_and_a_true_summary(ok_build: Built, streamed) -> None:
    stdout = ok_build.run.stdout
    runs = run_lines(stdout)
    sources = ["stock_photos", "web_images", "crawl_wds", "hf_photos"]
    chains = len(sources)
    assert [(p, s) for _, p, s in runs] == [*((n, "ok") for n in sources), (None, "ok"), *((n, "ok") for n in sources)]
    assert all(a.split(", ")[-1] == "mds_shards" for a, p, _ in runs[:chains]), runs
    assert runs[chains][0] == "duplicates" and all(a == "skip_lists, explorer" for a, _, _ in runs[chains + 1:])
    assert re.search(rf"^{len(runs)} runs in \d+ s: ok$", stdout, re.M), stdout

    summary = parse_summary(stdout)
    assert set(summary) == {*sources, "total"}, stdout

    # the same numbers, counted independently from the Lance tables, the MDS tree and skip-list files
    root, reads = ok_build.root, streamed[0]
    mine: dict[str, Counter] = defaultdict(Counter)
    for r in table_rows(root, "samples", ["source"]):
        mine[r["source"]]["samples"] += 1
    for r in table_rows(root, "rejects", ["source"]):
        mine[r["source"]]["rejects"] += 1
    for r in table_rows(root, "buckets", ["source", "tier"]):
        mine[r["source"]]["bucketed"] += r["tier"] is not None
    for r in table_rows(root, "duplicates", ["source", "keeper"]):
        mine[r["source"]]["duplicates"] += not r["keeper"]
    keys, labels = caption_key_of(root), labels_of(root)
    for stream in published_streams(root / "mds"):
        source = stream.parent.parent.name
        mine[source]["streams"] += 1
        mine[source]["in_mds"] += index_count(stream)
    for read in reads.values():
        for row in read.by_index:
            label = labels.get(keys[row["sample_id"]])
            if label in ("text", "nsfw"):
                mine[read.source][label] += 1
    skipped: dict[str, set] = defaultdict(set)
    for skip in read_skip_files(root):
        skipped[skip["source"]].update((skip["tier"], skip["bucket"], i) for i in skip["indices"])
    for source, entries in skipped.items():
        mine[source]["skipped"] = len(entries)
    columns = SUMMARY_COLUMNS[1:]
    for source in sources:
        assert summary[source] == {c: mine[source][c] for c in columns}, (source, stdout)
    assert summary["total"] == {c: sum(mine[s][c] for s in sources) for c in columns}, stdout
    # and the totals are what the demo plants: all but the undecodable files are samples, every
    # bucketed sample reaches MDS
    undecodable = [e for e in ok_build.manifest if e["reject"] and e["reject"] not in ("below_floor", "aspect_ratio")]
    assert summary["total"]["samples"] == len(ok_build.manifest) - len(undecodable)
    assert summary["total"]["rejects"] == sum(bool(e["reject"]) for e in ok_build.manifest)
    assert summary["total"]["in_mds"] == summary["total"]["bucketed"] == sum(len(r.by_index) for r in reads.values())


# -- 2. planted bad files end in rejects, everything else in samples ------------------------------

def test_every_planted_bad_file_is_rejected_with_its_reason(ok_build: Built) -> None:
    rejects = table_rows(ok_build.root, "rejects", ["sample_id", "source", "source_key", "stage", "reason"])
    got = {r["sample_id"]: r["reason"] for r in rejects}
    assert len(got) == len(rejects), "a sample is rejected twice"
    planted = {e["sample_id"]: e["reject"] for e in ok_build.manifest if e["reject"]}
    wrong = {sid: (reason, got.get(sid)) for sid, reason in planted.items() if got.get(sid) != reason}
    assert not wrong, f"planted -> (expected reason, found): {wrong}"
    assert set(got) == set(planted), f"rejected but not planted: {sorted(set(got) - set(planted))}"
    for r in rejects:
        assert r["sample_id"] == f"{r['source']}/{r['source_key']}"

    samples = {r["sample_id"] for r in table_rows(ok_build.root, "samples", ["sample_id"])}
    missing = [e["sample_id"] for e in ok_build.manifest if not e["reject"] and e["sample_id"] not in samples]
    assert not missing, f"manifest samples absent from `samples`: {missing}"
    # size guards act after decoding: those samples are in `samples` too, the undecodable ones are not
    for e in ok_build.manifest:
        if e["reject"]:
            assert (e["sample_id"] in samples) == (e["reject"] in ("below_floor", "aspect_ratio")), e


# -- 3. planted duplicates ------------------------------------------------------------------------

def skip_entries(root: Path, reason: str) -> dict[str, tuple[str, int]]:
    """sample_id -> (stream `<source>/<tier>/<bucket>`, index) for one skip reason."""
    out = {}
    for skip in read_skip_files(root):
        if skip["reason"] != reason:
            continue
        assert skip["header"]["reason"] == reason and skip["header"]["count"] == len(skip["indices"])
        for index, sid in zip(skip["indices"], skip["sample_ids"]):
            out[sid] = (f"{skip['source']}/{skip['tier']}/{skip['bucket']}", index)
    return out


def stream_of(reads: dict[str, StreamRead], sample_id: str) -> tuple[str, int] | None:
    for rel, read in reads.items():
        for index, row in enumerate(read.by_index):
            if row["sample_id"] == sample_id:
                return rel, index
    return None


def test_planted_duplicates_keep_the_original_and_skip_the_copies(ok_build: Built, streamed, record_property) -> None:
    root, reads = ok_build.root, streamed[0]
    dups = {r["sample_id"]: r for r in table_rows(root, "duplicates")}
    skipped = skip_entries(root, "duplicate")
    everything_skipped = {sid for reason in ("duplicate", "text", "nsfw", "opt_out")
                          for sid in skip_entries(root, reason)}
    groups: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in ok_build.manifest:
        if e["group"]:
            groups[e["group"]][e["role"]].append(e)
    assert len(groups) == 10

    def assert_skipped_at_its_index(sid: str) -> None:
        assert sid in skipped, f"{sid} is not skip-listed as duplicate"
        stream, index = skipped[sid]
        row = reads[stream].by_index[index]
        assert row["sample_id"] == sid, f"skip-list {stream} index {index} is {row['sample_id']} in MDS, not {sid}"

    resized_matched = 0
    for group, roles in sorted(groups.items()):
        [original] = roles["original"]
        oid = original["sample_id"]
        assert original["source"] == "stock_photos"
        members = [e for rs in roles.values() for e in rs]
        assert original["size"][0] * original["size"][1] == max(e["size"][0] * e["size"][1] for e in members)
        assert oid in dups and dups[oid]["keeper"], f"{group}: original {oid} is not the keeper: {dups.get(oid)}"
        assert oid not in everything_skipped, f"{group}: the keeper {oid} is skip-listed"
        assert stream_of(reads, oid) is not None, f"{group}: the keeper {oid} is not in MDS"
        for e in roles.get("copy", []) + roles.get("reencode", []):
            sid = e["sample_id"]
            assert sid in dups and not dups[sid]["keeper"] and dups[sid]["keeper_sample_id"] == oid, (group, e["role"], dups.get(sid))
            assert_skipped_at_its_index(sid)
        for e in roles["resize50"]:
            sid = e["sample_id"]
            if sid in dups:
                assert not dups[sid]["keeper"] and dups[sid]["keeper_sample_id"] == oid, (group, dups[sid])
                assert_skipped_at_its_index(sid)
                resized_matched += 1
            else:
                assert sid not in skipped
    # nothing but planted copies is flagged as a duplicate, and renders of one template that differ only
    # in their text (the demo's inbox screenshots, slides, spreadsheets: the documented limit of 16x16
    # signatures, docs/images.md's deduplication section), which their `text` label skips anyway
    planted_members = {e["sample_id"] for rs in groups.values() for r, es in rs.items() if r != "original" for e in es}
    templates = {e["sample_id"] for e in ok_build.manifest if "text_heavy" in e["kinds"]}
    assert set(skipped) <= planted_members | templates, sorted(set(skipped) - planted_members - templates)
    rate = resized_matched / len(groups)
    record_property("resize50_match_rate", rate)
    print(f"\n50% resizes grouped with their original: {resized_matched}/{len(groups)} ({rate:.0%})")
    assert rate == 1.0


# -- 4. planted text-heavy images ----------------------------------------------------------------

def test_planted_text_heavy_images_are_labelled_and_skipped(ok_build: Built, streamed) -> None:
    root, reads = ok_build.root, streamed[0]
    keys, labels = caption_key_of(root), labels_of(root)
    skipped = skip_entries(root, "text")
    text_heavy = [e for e in ok_build.manifest if "text_heavy" in e["kinds"]]
    assert len(text_heavy) == 16  # four per source
    for e in text_heavy:
        sid = e["sample_id"]
        assert labels.get(keys[sid]) == "text", (sid, e["kinds"], labels.get(keys[sid]))
        assert sid in skipped, f"{sid} ({e['kinds']}) is not skip-listed as text"
        stream, index = skipped[sid]
        assert reads[stream].by_index[index]["sample_id"] == sid
    photos = [e["sample_id"] for e in ok_build.manifest if e["kinds"][:1] == ["photo"] and e["sample_id"] in skipped]
    assert not photos, f"photos skip-listed as text: {photos}"


# -- 5. every stream loads the way the trainer finds it -----------------------------------------------

def test_every_stream_loads_with_streaming(ok_build: Built, streamed) -> None:
    reads, iterated = streamed
    streams = published_streams(ok_build.root / "mds")
    assert len(reads) == len(streams) > 0
    expected_total = sum(index_count(s) for s in streams)
    assert expected_total == len(table_rows(ok_build.root, "mds_index", ["sample_id"]))
    for rel, read in reads.items():
        width, height = (int(v) for v in read.bucket.split("x"))
        assert len(read.by_index) == index_count(ok_build.root / "mds" / rel) > 0
        for row in read.by_index:
            assert row["_columns"] == MDS_COLUMNS, (rel, sorted(row["_columns"]))
            assert row["image"] == ((width, height), "RGB", "JPEG"), (rel, row["sample_id"], row["image"])
            assert (row["width"], row["height"]) == (width, height)
            assert row["source"] == read.source and row["sample_id"].startswith(read.source + "/")
            assert row["original_width"] > 0 and row["original_height"] > 0
            assert isinstance(row["caption"], str) and row["caption"]
            assert isinstance(row["original_caption"], str)
    # iteration (what a trainer's DataLoader does) yields every sample exactly once
    ids = [row["sample_id"] for row in iterated]
    assert len(ids) == expected_total == len(set(ids))
    assert set(ids) == {row["sample_id"] for read in reads.values() for row in read.by_index}


# -- 6. rerun: identical tables, MDS and skip-lists, captions reused ------------------------------------

@pytest.fixture(scope="module")
def rerun(ok_build: Built) -> tuple[Run, dict[str, list[dict[str, Any]]]]:
    """The same build again, in place; with the `captions` metadata the instance held before."""
    before = captions_metadata(ok_build.home)
    result = run_cli(*build_args(ok_build.demo / "sources.yaml", ok_build.root, ok_build.home))
    print(f"\nrerun: {result.seconds:.0f} s, exit {result.returncode}")
    return result, before


def test_rerun_is_identical_and_reuses_captions(ok_build: Built, rerun) -> None:
    rerun, captions_before = rerun
    assert rerun.returncode == 0, rerun.explain()
    root = ok_build.root
    for name in TABLES:
        rows = table_snapshot(root, name)
        keys = [tuple(dict(r)[k] for k in TABLE_KEYS[name]) for r in rows]
        assert len(keys) == len(set(keys)), f"{name}: duplicate keys after the rerun"
        assert rows == ok_build.tables[name], f"{name}: contents changed on rerun ({len(rows)} vs {len(ok_build.tables[name])} rows)"
    assert hash_tree(root / "mds") == ok_build.mds, "MDS shards / index.json differ after the rerun"
    assert hash_tree(root / "skiplists") == ok_build.skiplists, "skip-list files differ after the rerun"
    assert hash_tree(root / "manifests") == ok_build.manifests, "tier manifests differ after the rerun"
    assert any(name.endswith("current.json") for name in ok_build.manifests)
    assert parse_summary(rerun.stdout) == parse_summary(ok_build.run.stdout)

    after = captions_metadata(ok_build.home)  # every stage of every source reused its committed run
    for source in ("stock_photos", "web_images", "crawl_wds"):
        assert len(after[source]) == len(captions_before[source]) + 1, source
        latest, previous = after[source][0], after[source][1]
        assert {k: latest[k] for k in ("eligible", "captioned", "reused", "failed")} == {
            k: previous[k] for k in ("eligible", "captioned", "reused", "failed")}, (source, latest)
        for stage in ("samples", "buckets", "phashes", "captions", "caption_labels", "caption_embeddings", "mds_shards"):
            assert f"{stage}[{source}]: unchanged since its last commit" in rerun.output, (stage, source)


# -- 7. SIGKILL in the middle of `samples` --------------------------------------------------------------

def copy_root(built: Built, dest: Path) -> Path:
    shutil.copytree(built.root, dest / "corpus", symlinks=True)
    return dest / "corpus"


def test_sigkill_during_samples_loses_and_duplicates_nothing(ok_build: Built, tmp_path: Path) -> None:
    root = copy_root(ok_build, tmp_path)
    assert force_next_run(Storage(str(root)), "samples", "web_images")  # unchanged: force the re-ingest
    samples_uri = table_uri(root, "samples")
    version_before = lance.dataset(samples_uri).version
    rows_before = table_snapshot(root, "samples")
    rejects_before = table_snapshot(root, "rejects")
    data_files_before = set(os.listdir(Path(samples_uri) / "data"))
    # `samples` alone: the copy's raw_source table is what it reads; re-listing it proves nothing here
    args = build_args(ok_build.demo / "sources.yaml", root, tmp_path / "dh", "--source", "web_images",
                      "--select", "samples")

    clock = Clock("samples kill")
    paused = Paused(args, "samples:before_commit", tmp_path / "kill")
    paused.wait_for_marker()
    clock("paused")
    try:
        new_files = set(os.listdir(Path(samples_uri) / "data")) - data_files_before
        assert new_files, "paused before any Lance fragment of the new ingest was written"
        assert lance.dataset(samples_uri).version == version_before  # nothing committed yet
    except BaseException:
        paused.kill()  # never leave the paused build running behind a failed assertion
        raise
    survivors = paused.kill()
    assert not survivors, f"processes of the killed build outlived SIGKILL of its group: {survivors}"
    clock("killed")

    dataset = lance.dataset(samples_uri)
    assert dataset.version == version_before, "the killed ingest committed a version"
    assert table_snapshot(root, "samples") == rows_before, "rows changed after the kill"
    assert table_snapshot(root, "rejects") == rejects_before

    result = run_cli(*args)
    clock("rerun")
    assert result.returncode == 0, result.explain()
    after = table_snapshot(root, "samples")
    ids = [dict(r)["sample_id"] for r in after]
    assert len(ids) == len(set(ids)), "duplicate sample_ids after the rerun"
    assert after == ok_build.tables["samples"], "rows lost, duplicated or changed after kill + rerun"
    assert table_snapshot(root, "rejects") == ok_build.tables["rejects"]


# -- 8. SIGKILL in the middle of `mds_shards` ------------------------------------------------------

def stream_contents(streams: list[Path]) -> dict[str, list[tuple[str, str, str]]]:
    """stream folder -> (sample_id, SHA-256 of the stored image, caption) in index order: what a
    trainer reads, whatever the chunk folders are called."""
    from prx_core.shards.mds.read import read_stream_rows

    return {f"{s.parent.parent.name}/{s.parent.name}/{s.name}": [
        (r["sample_id"], hashlib.sha256(r["image"]).hexdigest(), r["caption"]) for r in read_stream_rows(str(s))]
        for s in streams}


def test_sigkill_during_mds_shards_never_exposes_a_partial_stream(ok_build: Built, tmp_path: Path) -> None:
    """Another chunk size (chunks of other content: written anew), killed after one chunk:
    the published streams never change until the rerun publishes complete new ones."""
    source = "web_images"
    root = copy_root(ok_build, tmp_path)
    mds = root / "mds"
    before = hash_tree(mds / source)
    assert before == {k[len(source) + 1:]: v for k, v in ok_build.mds.items() if k.startswith(source + "/")}
    contents = stream_contents(published_streams(mds, source))
    expected = {s.relative_to(mds).as_posix(): index_count(s) for s in published_streams(mds, source)}
    config = tmp_path / "chunks.yaml"
    config.write_text("units: {mds_chunk_rows: 1}\n")  # one sample per chunk: every stream of 2+ is new
    args = build_args(ok_build.demo / "sources.yaml", root, tmp_path / "dh", "--source", source, "--select",
                      "mds_shards", "--config", str(config))

    def assert_published_streams_whole(label: str, n: int) -> None:
        published = published_streams(mds, source)
        assert {s.relative_to(mds).as_posix(): index_count(s) for s in published} == expected, label
        assert stream_contents(published) == contents, f"{label}: published streams of {source} changed"
        reads, iterated = load_streams(published, mds, tmp_path / f"read-{n}" / "mds")
        assert {rel: len(r.by_index) for rel, r in reads.items()} == expected, label
        assert len(iterated) == sum(expected.values()), label

    clock = Clock("mds_shards kill")
    paused = Paused(args, "mds_shards:chunks:4", tmp_path / "kill")
    paused.wait_for_marker()
    clock("paused")
    try:
        written = set(hash_tree(mds / source)) - set(before)
        assert written, "paused before any new chunk was written"
        assert_published_streams_whole("while paused", 1)
    except BaseException:
        paused.kill()  # never leave the paused build running behind a failed assertion
        raise
    clock("loaded while paused")
    survivors = paused.kill()
    assert not survivors, f"processes of the killed build outlived SIGKILL of its group: {survivors}"
    clock("killed")
    assert_published_streams_whole("after SIGKILL", 2)
    clock("loaded after kill")

    result = run_cli(*args)
    clock("rerun")
    assert result.returncode == 0, result.explain()
    assert stream_contents(published_streams(mds, source)) == contents, "streams differ after kill + rerun"
    assert not list((root / "_runs").rglob("run.json")), "an attempt was left behind"


# -- 8b. SIGKILL inside `captions`, rerun on the same Dagster home (issue 44, item 1) ----------------------

def test_sigkill_inside_captions_never_blocks_the_rerun(ok_build: Built, tmp_path: Path) -> None:
    """The killed build's run stays STARTED holding the `gpu` pool's only slot; the same command
    again used to wait for it forever at `captions`. It now marks that run failed, frees the slot
    and finishes what a clean build wrote, byte for byte."""
    source = "web_images"
    root = copy_root(ok_build, tmp_path)
    assert force_next_run(Storage(str(root)), "captions", source)  # unchanged: force the run
    # from `captions` on: the steps before it hold no pool slot, so they add time, not coverage
    args = build_args(ok_build.demo / "sources.yaml", root, tmp_path / "dh", "--source", source, "--select",
                      "captions,caption_labels,caption_embeddings,mds_shards")
    clock = Clock("captions kill")
    paused = Paused(args, "captions:units:1", tmp_path / "kill")
    paused.wait_for_marker()
    survivors = paused.kill()
    assert not survivors, f"processes of the killed build outlived SIGKILL of its group: {survivors}"
    clock("killed")

    result = run_cli(*args, timeout=600)
    clock("rerun")
    assert result.returncode == 0, result.explain()
    assert re.search(r"^reconciled: run [0-9a-f]{8} \(build_source \[web_images\]\) was left STARTED by a build "
                     r"whose process \(pid \d+\) is gone: marked failed$", result.stdout, re.M), result.stdout
    assert re.search(r"^reconciled: freed the gpu pool slots and queued steps of run [0-9a-f]{8} \(FAILURE\)$",
                     result.stdout, re.M), result.stdout
    for name in TABLES:
        assert table_snapshot(root, name) == ok_build.tables[name], f"{name} differs after kill + rerun"
    assert hash_tree(root / "mds") == ok_build.mds, "MDS shards / index.json differ after kill + rerun"
    assert not list((root / "_runs").rglob("run.json")), "an attempt was left behind"


# -- 9 and 10: runs independent of the demo build, started together ----------------------------------

def no_caption_catalog(work: Path) -> Path:
    """One image-folder source of 3 real JPEGs >= 512x512 with no caption sidecars."""
    folder = work / "nocaption"
    folder.mkdir()
    rng = np.random.default_rng(4)
    for i, (w, h) in enumerate([(640, 640), (768, 576), (576, 768)]):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels, "RGB").save(folder / f"img_{i}.jpg", quality=90)
    catalog = work / "sources.yaml"
    catalog.write_text(f"sources:\n- name: nocaption\n  format: imagefolder\n  uri: {folder}\n")
    return catalog


@pytest.fixture(scope="module")
def side_runs(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """A build that must fail its blocking check, and the bad invocations, all started at once:
    each bad one spends ~15 s importing before it can fail, so together they cost one."""
    work = tmp_path_factory.mktemp("side-runs")
    catalog = demo_dir / "sources.yaml"
    (work / "bad-section.yaml").write_text("no_such_section: {}\n")
    cases = {
        "no_captions": build_args(no_caption_catalog(work), work / "c0", work / "h0"),
        "source": build_args(catalog, work / "c1", work / "h1", "--source", "no_such_source"),
        "select": build_args(catalog, work / "c2", work / "h2", "--select", "samples,no_such_asset"),
        "catalog": build_args(work / "missing.yaml", work / "c3", work / "h3"),
        "config_missing": build_args(catalog, work / "c4", work / "h4", "--config", str(work / "missing-config.yaml")),
        "config_section": build_args(catalog, work / "c5", work / "h5", "--config", str(work / "bad-section.yaml")),
        "rerun": build_args(catalog, work / "c6", work / "h6", "--rerun", "captions,duplicates"),
        "rerun_unselected": build_args(catalog, work / "c7", work / "h7", "--select", "samples", "--rerun", "captions"),
    }
    started, procs = time.monotonic(), {}
    for name, args in cases.items():  # output to files: a full pipe must never stall a run
        with open(work / f"{name}.out", "w") as out, open(work / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen([CLI, *args], stdout=out, stderr=err, env=cli_env(), start_new_session=True)
    runs = {}
    for name, proc in procs.items():
        proc.wait(timeout=600)
        runs[name] = Run(cases[name], proc.returncode, (work / f"{name}.out").read_text(),
                         (work / f"{name}.err").read_text(), time.monotonic() - started)
    return runs


def test_a_source_without_captions_exits_nonzero_and_says_to_configure_a_vlm(side_runs: dict[str, Run]) -> None:
    """The default `source` captioner copies source captions: with none, the captions run fails
    naming the source and the fix (not a coverage check: nothing there is a captioner failure)."""
    result = side_runs["no_captions"]
    assert result.returncode == 1, result.explain()
    assert re.search(r"^captions \[nocaption\] FAILED: .*source 'nocaption': none of its 3 eligible images has a "
                     r"caption .*configure a VLM captioner.*\(docs/captioning\.md\)", result.stdout, re.M), result.explain()
    assert re.search(r"^\d+ runs in \d+ s: FAILED$", result.stdout, re.M), result.explain()
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("case, names", [
    ("source", ["no_such_source", "stock_photos"]),  # names the bad value and what is valid
    ("select", ["no_such_asset", "mds_shards"]),
    ("catalog", ["missing.yaml"]),
    ("rerun", ["duplicates", "captions, caption_labels"]),  # an unpartitioned asset: the per-source ones listed
    ("rerun_unselected", ["--rerun captions", "--select"]),
])
def test_bad_cli_input_is_a_clear_error(side_runs: dict[str, Run], case: str, names: list[str]) -> None:
    result = side_runs[case]
    assert result.returncode == 2, result.explain()
    assert "Traceback" not in result.output, result.explain()
    error = [line for line in result.stderr.splitlines() if line.startswith("prx-corpus: error:")]
    assert len(error) == 1 and all(n in error[0] for n in names), result.explain()
    assert not (Path(result.args[result.args.index("--root") + 1])).exists(), "a corpus root was created anyway"


@pytest.mark.parametrize("case, name", [("config_missing", "missing-config.yaml"),
                                        ("config_section", "no_such_section")])
def test_bad_config_file_is_a_clear_error(side_runs: dict[str, Run], case: str, name: str) -> None:
    result = side_runs[case]
    assert result.returncode == 2 and "Traceback" not in result.output, result.explain()
    assert name in result.stderr
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.caption_keys import caption_keys
