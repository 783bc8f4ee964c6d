"""`prx-corpus build` with hopeless sources beside a good one (issue 22, item 6; issue 27, item 1),
as an operator runs it: the summary names each hopeless source's cause in one line (not a
traceback, not a downstream "materialize `buckets` first"), says its downstream assets were
skipped, the good source goes all the way to MDS, and the build exits 1; the console shows no
traceback either (`--verbose` would). The hopeless ones: a URL table named as images (every row
refused), a wrong `uri` and a missing `image_column`; the last two are what preflight stops
before Ray starts (tests/e2e/test_build_interrupt.py), so this build passes `--no-preflight` to
check the causes a run gives when such a source gets past it. One tiny build (four sources, 3
photos, 6 URLs, 1 row).
"""

from __future__ import annotations

import re
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_build import Run, build_args, parse_summary, published_streams, run_cli, run_lines

from prx_core.demo.photos import load_skimage_photos

pytestmark = pytest.mark.slow

CHAIN = ["buckets", "phashes", "captions", "caption_labels", "caption_embeddings", "text_latents", "mds_shards",
         "skip_lists", "explorer"]


def write_sources(work: Path) -> Path:
    """`photos`: 3 real photos with sidecar captions. `laion`: a URL table whose catalog entry names
    the URL column as `image_column` (the mistake a metadata-only table invites)."""
    good = work / "photos"
    good.mkdir()
    colour = [p for p in load_skimage_photos() if p.image.mode == "RGB"][:3]
    for i, (photo, size) in enumerate(zip(colour, [(640, 480), (512, 512), (480, 640)])):
        photo.image.resize(size, Image.Resampling.BICUBIC).save(good / f"img_{i}.jpg", quality=90)
        (good / f"img_{i}.txt").write_text(photo.caption)
    bad = work / "laion"
    bad.mkdir()
    pq.write_table(pa.table({"URL": [f"https://example.org/{i}.jpg" for i in range(6)],
                             "TEXT": [f"a photo {i}" for i in range(6)]}), bad / "part-00000.parquet")
    table = work / "table"
    table.mkdir()
    pq.write_table(pa.table({"img": [b"not read"], "caption": ["a cat"]}), table / "part-0.parquet")
    catalog = work / "sources.yaml"
    catalog.write_text(f"sources:\n- {{name: photos, format: imagefolder, uri: {good}}}\n"
                       f"- {{name: laion, format: parquet, uri: {bad}, image_column: URL, caption_column: TEXT}}\n"
                       f"- {{name: lost, format: imagefolder, uri: {work / 'nope'}}}\n"
                       f"- {{name: tab, format: parquet, uri: {table}, image_column: image, caption_column: caption}}\n")
    return catalog


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    work = tmp_path_factory.mktemp("source-failures")
    root = work / "corpus"
    return root, run_cli(*build_args(write_sources(work), root, work / "home", "--no-preflight"))


def test_a_hopeless_source_says_why_and_the_good_one_completes(built: tuple[Path, Run]) -> None:
    root, result = built
    out = result.stdout
    assert result.returncode == 1, result.explain()
    assert "Traceback" not in out, result.explain()
    cause = [line for line in out.splitlines() if line.startswith("samples [laion] FAILED: ")]
    assert len(cause) == 1, result.explain()
    assert re.fullmatch(r"samples \[laion\] FAILED: source 'laion' \(parquet at \S+\): 6 of 6 rows refused, none "
                        r"kept \(not_an_image 6, e\.g\. \S+: \"not a recognised image [^\"]*\"\)\. Likely fix: the "
                        r"image column holds something other than image bytes \(URLs\? name that column `url_column`"
                        r".*rejects \(stage samples.*", cause[0]), cause[0]
    (skipped,) = [line for line in out.splitlines() if line.endswith("[laion] skipped: upstream samples failed")]
    assert skipped.split(" [")[0].split(", ") == CHAIN, skipped
    assert "materialize" not in out, result.explain()
    assert not [line for line in out.splitlines() if "FAILED: " in line and "[laion]" in line and line != cause[0]]
    assert re.search(r"^FAIL raw_source\+samples\+.*\[laion\] run [0-9a-f-]+$", out, re.M), result.explain()

    # the good source went all the way; the bad one's rejects are there to inspect
    assert ("raw_source, samples, buckets, phashes, captions, caption_labels, caption_embeddings, text_latents, "
            "mds_shards",
            "photos", "ok") in run_lines(out)
    assert ("skip_lists, explorer", "photos", "ok") in run_lines(out) and ("duplicates", None, "ok") in run_lines(out)
    assert not any(p != "photos" and a == "skip_lists, explorer" for a, p, _ in run_lines(out))  # never started
    summary = parse_summary(out)
    assert summary["photos"]["samples"] == 3 and summary["photos"]["in_mds"] == 3, result.explain()
    assert published_streams(root / "mds", "photos") and not published_streams(root / "mds", "laion")
    rejects = lance.dataset(str(root / "lance" / "rejects.lance")).to_table(filter="source = 'laion'").to_pylist()
    assert len(rejects) == 6 and {r["reason"] for r in rejects} == {"not_an_image"}
    assert re.search(r"^\d+ runs in \d+ s: FAILED$", out, re.M), result.explain()


def test_a_wrong_uri_and_a_missing_column_each_fail_in_one_line_and_the_console_stays_quiet(
        built: tuple[Path, Run]) -> None:
    _, result = built
    out = result.stdout
    failed = [line for line in out.splitlines() if " FAILED: " in line]
    assert [line.split(" FAILED: ")[0] for line in failed] == ["samples [laion]", "raw_source [lost]", "samples [tab]"]
    assert re.fullmatch(r"raw_source \[lost\] FAILED: FileNotFoundError: source 'lost': \S+/nope does not exist",
                        failed[1]), failed[1]
    assert re.fullmatch(r"samples \[tab\] FAILED: source 'tab' .*: 1 of 1 rows refused, none kept \(unreadable_fragment "
                        r"1, .*has no column\(s\) \['image'\] \(has \['img', 'caption'\]\).*Likely fix: .*column names in "
                        r"the catalog.*", failed[2]), failed[2]
    assert f"{', '.join(['samples', *CHAIN])} [lost] skipped: upstream raw_source failed" in out
    assert f"{', '.join(CHAIN)} [tab] skipped: upstream samples failed" in out
    # the runs' console: progress, but no traceback, failure event or dependency line
    for noise in ("Traceback", "Stack Trace", "STEP_FAILURE", "RUN_FAILURE", "Not executing"):
        assert noise not in result.stderr, (noise, result.explain())
    assert "samples[photos]: 1/1 units" in result.stderr, result.explain()
