"""Missing source captions under the `source` captioner are counted, not captioner failures; a
source with none at all fails the captions run at once; a VLM captioner's failures still count
(real local Ray, real Lance, the `openai` backend against a real loopback server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from corpora import write_contents

from prx_core.models.caption_base import NO_SOURCE_CAPTION, CaptionerConfig
from prx_core.models.caption_keys import source_caption_key
from prx_core.models.captioning import SOURCE_HAS_NONE, SourceCaptioner, missing_caption_message
from prx_core.models.serving import CaptionServer, Faults
from prx_core.stages.captions.stage import NoSourceCaptions, build_captions
from prx_core.stages.unchanged import force_next_run
from prx_core.store import lance_io
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")
SOURCE = CaptionerConfig("source")


def errors(storage: Storage, config: CaptionerConfig) -> dict[str, str]:
    """content_id -> stored error ("" when captioned) of that captioner's rows."""
    rows = lance_io.read_table(storage.lance_uri("captions"), filter=f"captioner_version = '{config.version()}'")
    return {r["content_id"]: r["error"] for r in rows.to_pylist()}


@pytest.fixture()
def storage(tmp_path: Path) -> Storage:
    return Storage(str(tmp_path / "corpus"))


def test_missing_source_captions_are_counted_apart_from_failures(storage: Storage) -> None:
    keys = [f"c{i}" for i in range(21)]
    captions = {k: None if k in ("c3", "c17") else f"a photo {k}" for k in keys}
    write_contents(storage, "web", {k: b"bytes " + k.encode() for k in keys}, captions, dropped=("c20",))
    for attempt in range(2):  # the uncaptioned are looked at again, and counted again, on a forced rerun
        if attempt:  # (a plain rerun reuses the committed run: the same rows, nothing failed)
            assert force_next_run(storage, "captions", "web")
        report = build_captions("web", storage, SOURCE, unit_rows=4)
        assert report.eligible == 20 and report.captioned + report.reused == 18
        assert (report.failed, report.failures, report.offenders) == (0, {}, [])
        assert report.without_source_caption == 2 and report.missing == 2 and report.captioner_missing == 0
        assert report.without_source_caption_examples == ["web/c17", "web/c3"]  # by sample_id
        assert report.reused == 18 * attempt
    stored = errors(storage, SOURCE)  # keyed by (content, source caption): prx_core.models.caption_keys
    uncaptioned = sorted(source_caption_key(c, None) for c in ("c3", "c17"))
    assert sorted(c for c, e in stored.items() if e) == uncaptioned
    assert all(stored[c].startswith(NO_SOURCE_CAPTION) for c in uncaptioned)
    assert len(stored) == 20 and source_caption_key("c20", None) not in stored


def test_a_source_without_any_caption_fails_at_once_naming_it_and_the_fix(storage: Storage) -> None:
    keys = [f"k{i}" for i in range(5)]
    write_contents(storage, "urls_only", {k: k.encode() for k in keys})
    with pytest.raises(NoSourceCaptions) as refused:
        build_captions("urls_only", storage, SOURCE, unit_rows=2)
    message = str(refused.value)
    assert message.startswith("source 'urls_only': none of its 5 eligible images has a caption")
    for needed in ("`source`", "backend: vllm", "backend: openai", "endpoint:", "backend: transformers", "model:",
                   "PRX_CONFIG", "docs/captioning.md", "caption_column"):
        assert needed in message, needed
    assert "\n" not in message


def test_shared_bytes_never_lend_another_source_its_caption(storage: Storage) -> None:
    """b's images include a's bytes but b has no caption of its own: a's captions are a's, so b
    has none (refused as a source without captions); once b has captions, its own are used, and
    the bytes with the very same text share a's row."""
    write_contents(storage, "a", {"c1": b"one", "c2": b"two"}, {"c1": "a lake", "c2": "a road"})
    write_contents(storage, "b", {"c1": b"one", "c2": b"two", "b0": b"three"})
    build_captions("a", storage, SOURCE)
    with pytest.raises(NoSourceCaptions):
        build_captions("b", storage, SOURCE)
    write_contents(storage, "b", {"c1": b"one", "c2": b"two", "b0": b"three"}, {"c1": "a lake", "c2": "b's road"})
    report = build_captions("b", storage, SOURCE)
    assert (report.eligible, report.reused, report.captioned, report.without_source_caption) == (3, 1, 1, 1)
    assert report.captioner_missing == 0 and report.without_source_caption_examples == ["b/b0"]


def test_vlm_captioner_failures_count_against_coverage_without_source_captions(storage: Storage,
                                                                             photos: list[bytes]) -> None:
    """Every request of the openai backend fails (HTTP 500, no retry): captioner failures, counted
    by the coverage check, while the missing source captions do not matter to a VLM."""
    write_contents(storage, "web", {f"p{i}": photo for i, photo in enumerate(photos)})  # no source captions
    stand_in = SourceCaptioner(SOURCE)  # never called: the server fails every request before captioning
    with CaptionServer(stand_in, "vlm", faults=Faults(rate=1.0, fault=500)) as server:
        config = CaptionerConfig("openai", model="vlm", endpoint=server.url, max_retries=0, concurrency=1)
        report = build_captions("web", storage, config)
        assert server.stats.requests == 3
    assert (report.eligible, report.captioned, report.failed, report.failures) == (3, 0, 3, {"http_error": 3})
    assert report.without_source_caption == 0 and report.captioner_missing == 3
    assert [o["sample_id"] for o in report.offenders] == ["web/p0", "web/p1", "web/p2"]
    assert all(e.startswith("http_error") for e in errors(storage, config).values())


def test_mds_reject_message_says_why_a_sample_has_no_caption() -> None:
    assert missing_caption_message("v1", f"{NO_SOURCE_CAPTION}: the source has no caption") == SOURCE_HAS_NONE
    assert SOURCE_HAS_NONE == ("the source has no caption and the captioner is `source`: configure a VLM captioner "
                               "(docs/captioning.md)")
    assert missing_caption_message("v1", "http_error: 500") == (
        "captioning failed for captioner version v1 (http_error: 500); the next captions run retries it")
    assert missing_caption_message("v1", None) == "no caption for captioner version v1"
