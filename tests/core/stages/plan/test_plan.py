"""The plan of a source from a sample of it, against a real build (samples, buckets, source
captions, mds_shards on a real local Ray): rows, MDS samples, streams and MDS bytes within 10%.
The source is 1,600 photos of several shapes (some below the floor, some too elongated, some
without a caption) in 8 parquet files, of which the plan reads 240."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_core.demo.photos import load_skimage_photos
from prx_core.models.caption_base import CaptionerConfig
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.buckets import build_buckets
from prx_core.stages.captions.stage import build_captions
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.plan.estimates import Models, estimate
from prx_core.stages.plan.sample import SampleStats, spread, sample_source
from prx_core.stages.samples.stage import build_samples
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
ROWS, FILES, SAMPLE = 1_600, 8, 240
# (width, height, share): two landscape/portrait streams, a square one of another tier, one below
# the 384x384 floor, one outside the [0.5, 2] aspect range
SHAPES = [(640, 480, 0.5), (480, 640, 0.2), (800, 800, 0.1), (300, 260, 0.12), (1200, 400, 0.08)]


def write_source(folder: Path) -> SourceSpec:
    """Distinct photos (a random window of a real photo per row), 85% of them captioned."""
    rng = np.random.default_rng(7)
    bases = [p.image.convert("RGB") for p in load_skimage_photos()]
    shapes = rng.choice(len(SHAPES), ROWS, p=[s[2] for s in SHAPES])
    folder.mkdir()
    for f in range(FILES):
        keys, images, captions = [], [], []
        for i in range(f * ROWS // FILES, (f + 1) * ROWS // FILES):
            width, height, _ = SHAPES[shapes[i]]
            base = bases[int(rng.integers(len(bases)))]
            scale = min(base.width / width, base.height / height) * rng.uniform(0.4, 1.0)
            w, h = int(width * scale), int(height * scale)
            x, y = int(rng.integers(0, base.width - w + 1)), int(rng.integers(0, base.height - h + 1))
            buffer = io.BytesIO()
            base.crop((x, y, x + w, y + h)).resize((width, height)).save(buffer, "JPEG", quality=int(rng.integers(80, 93)))
            keys.append(f"p{i:05d}")
            images.append(buffer.getvalue())
            captions.append(f"photo {i} of a scene, {width}x{height}" if rng.random() < 0.85 else None)
        pq.write_table(pa.table({"key": keys, "image": images, "caption": captions}), folder / f"part-{f}.parquet")
    return SourceSpec(name="mixed", format="parquet", uri=str(folder), image_column="image", caption_column="caption",
                      key_column="key")


def test_a_sampled_plan_is_within_10_percent_of_the_build(tmp_path: Path) -> None:
    spec = write_source(tmp_path / "source")
    stats, size = sample_source(spec, SAMPLE)
    assert (stats.read, stats.fragments, size.fragments, size.rows) == (SAMPLE, FILES, FILES, ROWS)
    plan = estimate(spec.name, spec.format, stats, size, Models(), source_name_bytes=len(spec.name))

    storage = Storage(str(tmp_path / "corpus"))
    captioner = CaptionerConfig("source")
    build_samples(spec, storage)
    build_buckets(spec.name, storage)
    build_captions(spec.name, storage, captioner)
    build_mds(spec.name, storage, captioner.version())
    index = lance_io.read_table(storage.lance_uri("mds_index"), ["tier", "bucket"],
                                filter=source_predicate(spec.name)).to_pylist()
    shards = [p for p in (tmp_path / "corpus" / "mds" / spec.name).rglob("*.mds*") if p.is_file()]
    want = {"rows": ROWS, "mds_samples": len(index), "streams": len({(r["tier"], r["bucket"]) for r in index}),
            "mds_bytes": sum(p.stat().st_size for p in shards)}
    got = {"rows": plan.rows, "mds_samples": plan.mds_samples, "streams": len(plan.streams), "mds_bytes": plan.mds_bytes}
    assert want["streams"] == 3 and 0.5 * ROWS < want["mds_samples"] < 0.8 * ROWS
    for key, value in want.items():
        assert abs(got[key] - value) <= 0.1 * value, (key, got, want)
    print(f"plan {got}, build {want}")
    assert set(plan.dropped) == {"below_floor", "aspect_ratio"}
    assert plan.small_streams == [k for k, v in plan.streams.items() if v < 256] and 0 < len(plan.small_streams) < 3
    assert plan.core_hours["mds_shards"] > plan.core_hours["buckets"] > 0 and plan.gpu_hours["captions"] == 0


def test_a_vlm_plan_costs_gpu_hours_per_distinct_content() -> None:
    from prx_core.stages.plan.sample import Bucketed, SourceSize

    same = [Bucketed("512/640x480", False, 50_000, 0, "c1"), Bucketed("512/640x480", True, 50_000, 40, "c1")]
    stats = SampleStats(read=4, record_bytes=4 * 60_000, bucketed=same + [Bucketed("512/480x640", True, 40_000, 40, "c2")],
                        decoded=4, inspect_s=0.01, render_s=0.03)
    vlm = estimate("s", "parquet", stats, SourceSize(1, 0, 4_000_000, "parquet footers"), Models(vlm_captions=True))
    assert (vlm.mds_samples, vlm.contents, vlm.streams) == (3_000_000, 2_000_000, {"512/480x640": 1_000_000,
                                                                                  "512/640x480": 2_000_000})
    assert vlm.gpu_hours["captions"] == pytest.approx(2_000_000 / 20 / 3600)
    # the caption checks' retries: 5% of the captions generated again with the fallback decoding
    assert vlm.gpu_hours["caption_retries"] == pytest.approx(0.05 * 2_000_000 / 20 / 3600)
    assert any(n.startswith("caption checks: ~5.0% of 2,000,000 captions") for n in vlm.notes)
    costly = estimate("s", "parquet", stats, SourceSize(1, 0, 4_000_000, "parquet footers"),
                      Models(vlm_captions=True, retry_share=0.2))
    assert costly.gpu_hours["caption_retries"] == pytest.approx(4 * vlm.gpu_hours["caption_retries"])
    source = estimate("s", "parquet", stats, SourceSize(1, 0, 4_000_000, "parquet footers"), Models())
    assert source.mds_samples == 2_000_000 and source.gpu_hours["captions"] == 0  # uncaptioned: refused from MDS
    assert source.gpu_hours["caption_retries"] == 0 and not any("caption checks" in n for n in source.notes)
    by_bytes = estimate("s", "webdataset", stats, SourceSize(1, 600_000_000, None, "listed bytes"), Models())
    assert by_bytes.rows == 10_000 and "rows estimated from" in by_bytes.notes[0]


@pytest.mark.parametrize("items, count, want", [(list(range(10)), 3, [0, 3, 6]), ([1, 2], 5, [1, 2]), ([], 4, [])])
def test_fragments_are_spread_over_the_source(items: list[int], count: int, want: list[int]) -> None:
    assert spread(items, count) == want
