"""A sample's caption is its own (issue 39, part 2): an image folder and a parquet (Hugging Face
style) source holding the same bytes under different captions, through the real stages (ingest,
buckets, captions, mds_shards, caption_labels, skip_lists, explorer rows) on a local Ray: under the
`source` captioner each sample's MDS caption is its own source's text, the same bytes with the same
text share one caption row; under a model captioner (the transformers backend on the tiny VLM)
the bytes are captioned once and both sources ship that one caption."""

from __future__ import annotations


import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.caption_keys import source_caption_key
from prx_core.models.label_base import LabelerConfig
from prx_core.models.tiny_vlm import TINY_MAX_PIXELS, build_tiny_qwen2_vl
from prx_core.shards.mds.read import read_stream_rows
from prx_core.shards.mds.streams import list_streams
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.buckets import build_buckets
from prx_core.stages.captions.stage import build_captions
from prx_core.stages.explorer.rows import SAMPLE_COLUMNS, explore_rows, sample_base
from prx_core.stages.labels import build_labels
from prx_core.stages.mds_shards.stage import build_mds
from prx_core.stages.samples.stage import build_samples
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store import lance_io
from prx_core.store.partitions import source_predicate
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster", "one_torch_thread")
SOURCE = CaptionerConfig("source")
FOLDER = {"a": "an astronaut in a white suit, from the folder", "b": "the very same words in both sources",
          "c": "a rocket only the folder has"}
HUB = {"x": "the hub dataset's own words for the astronaut", "y": "the very same words in both sources"}


def mds_captions(storage: Storage, source: str) -> dict[str, str]:
    """sample_id -> the caption its MDS row carries."""
    return {r["sample_id"]: r["caption"] for uri in list_streams(storage.root, source) for r in read_stream_rows(uri)}


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """Three real photos large enough to be bucketed (scikit-image's astronaut, coffee, rocket)."""
    import skimage
    from jpegs import jpeg

    return [jpeg(skimage.data.astronaut()), jpeg(skimage.data.coffee()), jpeg(skimage.data.rocket())]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, photos: list[bytes]) -> Storage:
    """Folder a, b, c; hub x (a's bytes, its own caption), y (b's bytes, b's very caption): ingested and bucketed."""
    root = tmp_path_factory.mktemp("ownership")
    folder = root / "folder"
    folder.mkdir()
    for (key, text), photo in zip(FOLDER.items(), photos):
        (folder / f"{key}.jpg").write_bytes(photo)
        (folder / f"{key}.txt").write_text(text)
    pq.write_table(pa.table({"key": list(HUB), "image": photos[:2], "caption": list(HUB.values())}),
                   root / "hub.parquet")
    storage = Storage(str(root / "corpus"))
    for spec in (SourceSpec("folder", "imagefolder", str(folder)),
                 SourceSpec("hub", "parquet", str(root / "hub.parquet"), image_column="image", caption_column="caption",
                            key_column="key")):
        build_samples(spec, storage)
        build_buckets(spec.name, storage)
    return storage


def test_each_sample_ships_its_own_source_caption(corpus: Storage) -> None:
    folder = build_captions("folder", corpus, SOURCE)
    hub = build_captions("hub", corpus, SOURCE)
    assert (folder.eligible, folder.captioned) == (3, 3)
    assert (hub.eligible, hub.reused, hub.captioned) == (2, 1, 1)  # y shares b's bytes and b's very text
    for source in ("folder", "hub"):
        build_mds(source, corpus, SOURCE.version())
    shipped = {**mds_captions(corpus, "folder"), **mds_captions(corpus, "hub")}
    own = {**{f"folder/{k}": t for k, t in FOLDER.items()}, **{f"hub/{k}": t for k, t in HUB.items()}}
    assert shipped == own  # never the other source's text, though a and x are the same bytes

    samples = lance_io.read_table(corpus.lance_uri("samples"), ["sample_id", "content_id", "original_caption"])
    by_id = {r["sample_id"]: r for r in samples.to_pylist()}
    assert by_id["folder/a"]["content_id"] == by_id["hub/x"]["content_id"]
    stored = lance_io.read_table(corpus.lance_uri("captions"), filter=f"captioner_version = '{SOURCE.version()}'")
    assert sorted(stored["content_id"].to_pylist()) == sorted(  # one row per (content, caption): 4, not 5
        {source_caption_key(r["content_id"], r["original_caption"]) for r in by_id.values()})
    assert set(stored["verdict"].to_pylist()) == {"ok"} and set(stored["attempts"].to_pylist()) == {0}
    assert set(stored["image_content_id"].to_pylist()) == {r["content_id"] for r in by_id.values()}  # beside its key

    # labels and skip-lists follow the same keys: every shipped sample is labelled, none skipped as unlabelled
    labeler = LabelerConfig()
    for source in ("folder", "hub"):
        assert build_labels(source, corpus, SOURCE.version(), labeler).failed == 0
        skips = build_skip_lists(source, corpus, SOURCE.version(), labeler.version(), SkipPolicy(duplicates=False))
        assert skips.samples == len(own) - (2 if source == "folder" else 3)
        assert not any("unlabelled" in s.by_reason for s in skips.streams), skips.streams  # labels found by key

    # the explorer names the caption by what produced it, and shows each sample its own
    read = lance_io.read_table(corpus.lance_uri("samples"), SAMPLE_COLUMNS + ["metadata"])
    inputs = {t: lance_io.table_version(corpus.lance_uri(t)) for t in ("captions", "caption_labels")}
    rows = explore_rows(corpus, inputs, sample_base(read), {"captioner_version": SOURCE.version(),
                                                           "labeler_version": labeler.version()}).to_pylist()
    assert {r["sample_id"]: r["caption"] for r in rows} == own
    assert {r["captioner_id"] for r in rows} == {"source"} and all(r["label"] for r in rows)


def test_a_model_caption_is_shared_by_the_same_bytes(corpus: Storage, tmp_path_factory: pytest.TempPathFactory) -> None:
    checkpoint = build_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl", seed=0)
    config = CaptionerConfig("transformers", model=str(checkpoint), max_new_tokens=8, max_pixels=TINY_MAX_PIXELS,
                             check_captions=False)  # the tiny model's gibberish would fail them (test_caption_quality)
    folder = build_captions("folder", corpus, config)
    hub = build_captions("hub", corpus, config)
    assert (folder.captioned, hub.reused, hub.captioned) == (3, 2, 0)  # the hub's two images are the folder's bytes
    for source in ("folder", "hub"):
        build_mds(source, corpus, config.version())
    folder_mds, hub_mds = mds_captions(corpus, "folder"), mds_captions(corpus, "hub")
    assert hub_mds["hub/x"] == folder_mds["folder/a"] and hub_mds["hub/y"] == folder_mds["folder/b"]
    assert hub_mds["hub/x"] not in (HUB["x"], FOLDER["a"])  # the model's words, not a source's
    stored = lance_io.read_table(corpus.lance_uri("captions"), filter=f"captioner_version = '{config.version()}'")
    contents = lance_io.read_table(corpus.lance_uri("samples"), ["content_id"], source_predicate("folder"))
    assert sorted(stored["content_id"].to_pylist()) == sorted(contents["content_id"].to_pylist())  # keyed by content
    assert set(stored["verdict"].to_pylist()) == {"unchecked"}
