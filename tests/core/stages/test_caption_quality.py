"""The caption checks through the real stages (issue 39, part 3), on a local Ray and real Lance:
the transformers backend on the tiny VLM (its random weights loop and never stop, a real case)
retries every caption with the fallback decoding, stores them rejected with their reasons, never
retries them again, and mds_shards refuses them as `caption_rejected`; a corpus captioned before the
checks existed is checked on the next run and only its failing captions are made again."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pytest
from corpora import write_contents

from prx_core.models.caption_base import CaptionerConfig, Captioner, CaptionResult
from prx_core.models.serving import CaptionServer
from prx_core.models.tiny_vlm import TINY_MAX_PIXELS, build_tiny_qwen2_vl
from prx_core.stages.captions.stage import build_captions
from prx_core.stages.mds_shards.chunks import CAPTION_REJECTED
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.unchanged import force_next_run
from prx_core.store import lance_io, schemas
from prx_core.store.partitions import rejects_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster", "one_torch_thread")
GOOD = " ".join(["A photograph of a lighthouse on a rocky headland under a pale sky."] +
                [f"Detail {i} of the scene is visible in the frame." for i in range(6)])


def stored(storage: Storage, version: str) -> dict[str, dict]:
    rows = lance_io.read_table(storage.lance_uri("captions"), filter=f"captioner_version = '{version}'")
    return {r["content_id"]: r for r in rows.to_pylist()}


@pytest.fixture()
def storage(tmp_path: Path, photos: list[bytes]) -> Storage:
    storage = Storage(str(tmp_path / "corpus"))
    write_contents(storage, "web", {f"p{i}": photo for i, photo in enumerate(photos)})
    return storage


def test_the_tiny_vlm_loops_is_retried_once_then_rejected_and_kept_out_of_mds(
        storage: Storage, tmp_path_factory: pytest.TempPathFactory) -> None:
    checkpoint = build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl", seed=0)
    config = CaptionerConfig("transformers", model=str(checkpoint), max_new_tokens=12, max_pixels=TINY_MAX_PIXELS)
    report = build_captions("web", storage, config)
    assert (report.eligible, report.captioned, report.failed, report.missing) == (3, 3, 0, 0)
    assert report.fallbacks == report.rejected == report.rejected_now == 3 and report.retried == 0
    assert report.captioner_missing == 0 and report.shippable == 0  # no coverage failure, nothing to ship
    assert sum(report.quality.values()) == 3 and all(k.startswith("rejected:") for k in report.quality)
    assert 3 * 12 < report.output_tokens <= 6 * 12  # both attempts of each caption are counted
    assert sorted(o["sample_id"] for o in report.rejected_offenders) == ["web/p0", "web/p1", "web/p2"]
    rows = stored(storage, config.version())
    assert {(r["verdict"], r["attempts"], r["finish_reason"]) for r in rows.values()} == {("rejected", 2, "length")}
    assert all(r["caption"] and r["error"] == "" and r["problem"] in ("token_cap", "repetition") for r in rows.values())

    same = build_captions("web", storage, config)  # the same manifest, its outputs in place: nothing runs
    assert (same.units.ran, same.units.skipped, same.rejected) == (0, same.units.units, 3)
    assert force_next_run(storage, "captions", "web")  # forced, as docs/operations.md says
    again = build_captions("web", storage, config)  # a rejected caption is a verdict: never retried by a rerun
    assert (again.reused, again.captioned, again.fallbacks, again.rejected) == (3, 0, 0, 3)
    assert again.quality == report.quality

    mds = build_mds("web", storage, config.version())
    assert mds.written == 0 and mds.rejects == {CAPTION_REJECTED: 3}
    rejects = lance_io.read_table(storage.lance_uri("rejects"), filter=rejects_predicate("web", "mds_shards"))
    assert set(rejects["reason"].to_pylist()) == {CAPTION_REJECTED}
    assert all("failed the caption checks twice" in m and "fallback decoding" in m for m in rejects["message"].to_pylist())


class Fixed(Captioner):
    """Writes one good paragraph for any image: the model that captions a refused caption again."""

    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None],
                      fallback: bool = False) -> list[CaptionResult]:
        return [CaptionResult(GOOD, finish_reason="stop") for _ in images]


def test_captions_stored_before_the_checks_are_checked_and_only_the_failing_made_again(storage: Storage) -> None:
    with CaptionServer(Fixed(CaptionerConfig("source")), "vlm") as server:
        config = CaptionerConfig("openai", model="vlm", endpoint=server.url, max_retries=0, concurrency=1)
        loop = "a lighthouse " + "and the wall, " * 20
        old = [{"content_id": c, "captioner_version": config.version(), "captioner_id": config.captioner_id(),
                "prompt_version": "caption-v1", "caption": text, "word_count": len(text.split()), "error": ""}
               for c, text in (("p0", GOOD), ("p1", loop), ("p2", GOOD))]
        lance_io.overwrite(storage.lance_uri("captions"), pa.Table.from_pylist(  # a table from before the checks
            old, schema=pa.schema(list(schemas.CAPTIONS)[:7])))
        report = build_captions("web", storage, config)
        assert server.stats.requests == 1  # only the loop is captioned again
    assert (report.eligible, report.reused, report.captioned, report.rechecked) == (3, 2, 1, 1)
    assert report.rejected == report.fallbacks == 0 and report.quality == {"ok": 3}
    rows = stored(storage, config.version())
    assert len(rows) == 3 and rows["p1"]["caption"] == GOOD and rows["p1"]["verdict"] == "ok"  # replaced, not added
    assert rows["p0"]["verdict"] is None and rows["p0"]["caption"] == GOOD  # passed: left as it was
