"""`prx-corpus plan` on the demo sources against what the build of them produced: rows, MDS
samples, streams and MDS bytes within 10% per source (the demo is smaller than the default
sample, so the plan reads all of it; the sampled case is tests/core/stages/test_plan.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from demo_corpus import Corpus, SOURCES

from prx_cli.main import main
from prx_core.stages.plan.estimates import Models, estimate
from prx_core.stages.plan.sample import sample_source
from prx_core.store.partitions import source_predicate


def built(corpus: Corpus, source: str) -> dict[str, int]:
    """What the build wrote for `source`: rows read, MDS samples, streams, MDS shard bytes."""
    where = source_predicate(source)
    index = corpus.table("mds_index", ["tier", "bucket"], filter=where).to_pylist()
    shards = [p for p in (corpus.root / "mds" / source).rglob("*.mds*") if p.is_file()]
    return {"rows": corpus.table("samples", ["sample_id"], filter=where).num_rows
            + corpus.table("rejects", ["sample_id"], filter=f"{where} AND stage = 'samples'").num_rows,
            "mds_samples": len(index), "streams": len({(r["tier"], r["bucket"]) for r in index}),
            "mds_bytes": sum(p.stat().st_size for p in shards)}


@pytest.mark.parametrize("source", SOURCES)
def test_the_plan_of_a_demo_source_is_within_10_percent_of_its_build(corpus: Corpus, source: str) -> None:
    spec = next(s for s in corpus.catalog.sources if s.name == source)
    stats, size = sample_source(spec)
    plan = estimate(source, spec.format, stats, size, Models(), source_name_bytes=len(source))
    want = built(corpus, source)
    got = {"rows": plan.rows, "mds_samples": plan.mds_samples, "streams": len(plan.streams), "mds_bytes": plan.mds_bytes}
    for key, value in want.items():
        assert value > 0 and abs(got[key] - value) <= 0.1 * value, (source, key, got, want)


def test_the_command_prints_every_source_and_writes_json(corpus: Corpus, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--sources", str(corpus.sources), "--sample", "40", "--gpus", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert all(f"| {s} |" in printed for s in SOURCES)
    assert re.search(r"wall time on this machine \(.+\), with --gpus: \d+ cores, 2 GPUs: ", printed), printed
    import json

    plan = json.loads(out.read_text())
    assert [p["source"] for p in plan["sources"]] == list(SOURCES)
    assert all(p["sampled"] <= 40 + 20 for p in plan["sources"])  # the quota per fragment, rounded up
    assert plan["totals"]["rows"] == sum(p["rows"] for p in plan["sources"])


def test_a_bad_request_names_the_fix(corpus: Corpus, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--sources", str(corpus.sources), "--source", "nope"]) == 2
    assert "--source: nope not in" in capsys.readouterr().err


def test_the_corpus_plan_asset_shows_the_plan(corpus: Corpus) -> None:
    import dagster as dg

    from prx_assets.corpus_plan import corpus_plan

    result = dg.materialize([corpus_plan], resources=corpus.resources, instance=dg.DagsterInstance.ephemeral(),
                            run_config={"ops": {"corpus_plan": {"config": {"sample": 30, "gpus": 0}}}})
    assert result.success
    (event,) = result.get_asset_materialization_events()
    meta = event.materialization.metadata
    table = meta["plan"].value
    assert all(f"| {s} |" in table for s in SOURCES) and meta["sources"].value == len(SOURCES)
    assert meta["dagster/row_count"].value >= 300
    assert re.fullmatch(r"the run's Ray cluster: [1-9]\d* cores, 0 GPUs", meta["cluster"].value), meta["cluster"].value
    assert meta["gpu_hours"].value == 0.0 and meta["wall_hours"].value > 0  # source captions: no GPU needed


def test_the_plan_says_how_a_vllm_captioners_engines_are_sized() -> None:
    """The settings' captioner section as the plan reads it (prx_assets.corpus_plan.models_of):
    a known model on a known GPU is sized, `size_from_gpu: false` is not, and no VLM, no line."""
    from prx_assets.corpus_plan import models_of
    from prx_resources.models import CaptionerResource, LabelerResource
    from prx_resources.text_latents import TextLatentsResource
    from prx_resources.training import TrainingResource

    rest = (LabelerResource(), TrainingResource(), TextLatentsResource())
    gpu = {"backend": "vllm", "model": "Qwen/Qwen3-VL-8B-Instruct", "accelerator_type": "H200",
           "max_pixels": 802816, "max_new_tokens": 320}
    sized = models_of(CaptionerResource(**gpu), *rest).engines
    assert sized.startswith("vLLM engines of Qwen/Qwen3-VL-8B-Instruct on H200 x 1: 571 requests at once"), sized
    assert "size_from_gpu: false" in models_of(CaptionerResource(**gpu, size_from_gpu=False), *rest).engines
    assert models_of(CaptionerResource(), *rest).engines == ""
