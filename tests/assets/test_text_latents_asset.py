"""`text_latents` on the tiny Qwen2-VL, then `mds_shards` storing them: every sample of the source
carries PRX's `latent_caption_<preset>` (bfloat16, the caption's tokens) and
`attention_mask_caption_<preset>`, equal to the same model run directly through transformers,
read back by mosaicml-streaming and by CorpusDataset; a rerun encodes nothing and rewrites no chunk.
Off (the default), the asset encodes nothing and the streams carry no latent column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from demo_corpus import Corpus, copy_corpus, read, stream_dirs, tree_digest
from materializing import check, fresh_instance, materialize, materialized, resources_for, transformers_config

from prx_core.models.text_latents import clean_caption, encode_captions
from prx_core.shards.mds.encodings import latent_key, mask_key, register_encodings
from prx_core.stages.unchanged import force_next_run
from prx_core.store.storage import Storage

SOURCE = "crawl_wds"
PRESET = "tiny-16-bf16"


def latents_config(tiny_vlm: Path, masks: bool = True) -> dict:
    return {"text_latents": {"model": str(tiny_vlm), "preset": PRESET, "max_tokens": 16, "masks": masks,
                             "batch_size": 4},
            "units": {"text_latents_rows": 8}}  # several units, so reuse across units is exercised


def stored_samples(root: Path) -> list[dict]:
    """Every sample of the source's streams, as the trainer's streaming decodes them (one
    StreamingDataset over all of them: each instance holds shared memory until the process ends)."""
    from streaming import Stream, StreamingDataset

    register_encodings()  # what PRX's `mds_patches` import does in the trainer
    dataset = StreamingDataset(streams=[Stream(local=str(f)) for f in stream_dirs(root, SOURCE)], shuffle=False,
                               batch_size=1)
    return [dataset[i] for i in range(len(dataset))]


def direct_latents(tiny_vlm: Path, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, local_files_only=True, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm, local_files_only=True)
    return encode_captions(model, tokenizer, [clean_caption(c) for c in captions], 16)


@pytest.fixture(scope="module")
def encoded(corpus: Corpus, tiny_vlm: Path, tmp_path_factory: pytest.TempPathFactory):
    root = copy_corpus(corpus, tmp_path_factory.mktemp("latents") / "corpus")
    resources = resources_for(corpus, root, latents_config(tiny_vlm))
    result = materialize(resources, ["text_latents", "mds_shards", "skip_lists"], SOURCE, fresh_instance(corpus.catalog))
    assert result.success, [e.event_specific_data for e in result.all_events if e.is_failure]
    return root, resources, result


def test_every_sample_carries_the_latent_prx_reads(encoded, corpus: Corpus, tiny_vlm: Path) -> None:
    root, _, result = encoded
    meta = materialized(result)
    captioned = meta["text_latents"]["captioned"]
    assert captioned > 0 and meta["text_latents"]["encoded"] == captioned and meta["text_latents"]["reused"] == 0
    assert meta["text_latents"]["encoder"].startswith(f"{PRESET}:") and check(result, "text_latents_coverage").passed
    rows = read(root, "text_latents").to_pylist()
    assert len(rows) == len({r["content_id"] for r in rows}) == captioned

    samples = stored_samples(root)
    assert len(samples) == meta["mds_shards"]["samples_written"] > 0
    captions = [s["caption"] for s in samples]
    latents, masks = direct_latents(tiny_vlm, captions)
    for sample, latent, mask in zip(samples, latents, masks):
        stored, stored_mask = sample[latent_key("caption", PRESET)], sample[mask_key("caption", PRESET)]
        assert stored.dtype == torch.bfloat16 and stored.ndim == 2
        # PRX's loader contract (has_text_latents, has_mask_text_latents): a full-length mask whose
        # ones count the latent's rows; it pads the latent with zeros to the mask's length
        prx_mask = torch.tensor(stored_mask, dtype=torch.bool)
        assert prx_mask.shape == (16,) and int(prx_mask.sum()) == stored.shape[0] >= 1
        assert torch.equal(prx_mask, mask)
        assert torch.equal(stored, latent[:stored.shape[0]])  # the same model, run directly: bit for bit


def test_corpus_dataset_returns_the_tensors(encoded) -> None:
    from prx_core.shards.loader import CorpusDataset

    root, _, _ = encoded
    tier = int(stream_dirs(root, SOURCE)[0].parent.name)
    dataset = CorpusDataset(str(root), tier, sources=[SOURCE], batch_size=1, shuffle=False)
    sample = dataset[0]
    assert sample[latent_key("caption", PRESET)].dtype == torch.bfloat16
    mask = sample[mask_key("caption", PRESET)]
    assert mask.dtype == torch.bool and int(mask.sum()) == sample[latent_key("caption", PRESET)].shape[0]


def test_a_rerun_encodes_nothing_and_rewrites_no_chunk(encoded, corpus: Corpus) -> None:
    root, resources, first = encoded
    before = tree_digest(Path(root, "mds", SOURCE))
    assert force_next_run(Storage(str(root)), "text_latents", SOURCE)  # else the committed run is reused whole: nothing runs
    result = materialize(resources, ["text_latents", "mds_shards"], SOURCE, fresh_instance(corpus.catalog))
    assert result.success
    meta = materialized(result)
    assert meta["text_latents"]["encoded"] == 0
    assert meta["text_latents"]["reused"] == materialized(first)["text_latents"]["captioned"]
    assert tree_digest(Path(root, "mds", SOURCE)) == before


def test_without_masks_latents_are_full_length(corpus: Corpus, tiny_vlm: Path, tmp_path: Path) -> None:
    root = copy_corpus(corpus, tmp_path / "corpus")
    resources = resources_for(corpus, root, latents_config(tiny_vlm, masks=False))
    result = materialize(resources, ["text_latents", "mds_shards"], SOURCE, fresh_instance(corpus.catalog))
    assert result.success
    samples = stored_samples(root)
    assert samples and all(s[latent_key("caption", PRESET)].shape[0] == 16 for s in samples)  # PRX: prompt_max_tokens
    assert not any(mask_key("caption", PRESET) in s for s in samples)


def test_off_by_default_encodes_nothing(corpus: Corpus) -> None:
    meta = corpus.metadata("text_latents", SOURCE)
    assert meta["configured"] is False and meta["encoded"] == 0
    assert not any(k.startswith("latent_") for s in stored_samples(corpus.root) for k in s)


def test_fused_captioning_computes_the_same_latents_in_the_captioners_pass(corpus: Corpus, tiny_vlm: Path,
                                                                           tmp_path: Path) -> None:
    """One bfloat16 model per actor captions and encodes; `text_latents` then finds every latent
    stored, and they are the ones the encoder's own pass computes."""
    root = copy_corpus(corpus, tmp_path / "corpus")
    config = latents_config(tiny_vlm)
    config["text_latents"]["fused"] = True
    # the tiny model's gibberish would fail the caption checks (test_caption_quality): latents of every caption here
    config["captioner"] = {**transformers_config(tiny_vlm), "dtype": "bfloat16", "check_captions": False}
    resources = resources_for(corpus, root, config)
    result = materialize(resources, ["captions", "text_latents"], SOURCE, fresh_instance(corpus.catalog))
    assert result.success, [e.event_specific_data for e in result.all_events if e.is_failure]
    meta = materialized(result)
    assert meta["captions"]["captioned"] > 0 and meta["captions"]["latents_encoded"] == meta["captions"]["captioned"]
    assert meta["text_latents"]["encoded"] == 0 and meta["text_latents"]["reused"] == meta["captions"]["captioned"]
    version = resources["captioner"].config().version()
    captions = {r["content_id"]: r["caption"] for r in read(root, "captions").to_pylist()
                if r["captioner_version"] == version}
    rows = [r for r in read(root, "text_latents").to_pylist() if r["captioner_version"] == version]
    assert {r["content_id"] for r in rows} == set(captions)
    latents, masks = direct_latents(tiny_vlm, [captions[r["content_id"]] for r in rows])
    for row, latent, mask in zip(rows, latents, masks):
        assert row["tokens"] == int(mask.sum())
        stored = torch.frombuffer(bytearray(row["latent"]), dtype=torch.bfloat16).reshape(row["tokens"], -1)
        assert torch.equal(stored, latent[:row["tokens"]])


@pytest.mark.parametrize(("captioner", "message"), [
    ({}, "needs captioner.backend: transformers, not 'source'"),
    ({"dtype": "float32"}, "needs captioner.dtype: bfloat16"),
])
def test_fused_is_refused_when_one_model_cannot_serve(corpus: Corpus, tiny_vlm: Path, tmp_path: Path,
                                                      captioner: dict, message: str) -> None:
    from prx_assets.definitions import build_assets

    config = latents_config(tiny_vlm)
    config["text_latents"]["fused"] = True
    if captioner:
        config["captioner"] = {**transformers_config(tiny_vlm), **captioner}
    with pytest.raises(ValueError, match=message):
        build_assets(resources_for(corpus, tmp_path / "corpus", config))


def test_the_plan_sizes_the_latents_within_10_percent_of_the_build(encoded, corpus: Corpus, tiny_vlm: Path) -> None:
    """`prx-corpus plan` with text_latents configured: the MDS bytes (latents and masks included) and
    the `text_latents` table's latent bytes against what the build wrote."""
    from prx_cli.cmd_plan import plan_models
    from prx_assets.settings import Settings
    from prx_core.stages.plan.sample import sample_source
    from prx_core.stages.plan.estimates import estimate

    root, _, _ = encoded
    models = plan_models(Settings(str(root), str(corpus.sources), latents_config(tiny_vlm)), 20.0)
    assert models.latents is not None and models.latents.max_tokens == 16 and models.latents.masks
    spec = next(s for s in corpus.catalog.sources if s.name == SOURCE)
    plan = estimate(SOURCE, spec.format, *sample_source(spec), models, source_name_bytes=len(SOURCE))
    shards = sum(shard["raw_data"]["bytes"] for folder in stream_dirs(root, SOURCE)  # the published ones: the
                 for shard in json.loads((folder / "index.json").read_text())["shards"])  # old chunks are still there
    assert abs(plan.mds_bytes - shards) <= 0.1 * shards, (plan.mds_bytes, shards)
    latents = sum(len(r["latent"]) for r in read(root, "text_latents", ["latent"]).to_pylist())
    estimated = plan.storage_bytes["text_latents"] - plan.contents * 150  # the latents alone
    assert abs(estimated - latents) <= 0.1 * latents, (estimated, latents)
    assert any("text latents" in note for note in plan.notes)
