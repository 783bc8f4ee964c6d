"""Stage `captions`: caption every eligible content of a source once per captioner version.

Eligible means bucketed (not rejected, not dropped): nothing that cannot reach the corpus is
captioned. A model's captions are keyed by (`content_id`, captioner version) and shared by all
sources, so re-ingests, byte-identical images in two sources and reruns after a crash reuse them;
the `source` captioner's are keyed by (content, the sample's own caption), so a sample never
ships another source's text (prx_core.models.caption_keys). Every caption is checked before it is
stored (prx_core.models.caption_checks, prx_core.stages.captions.quality): a refused one is
generated once more with the fallback decoding, then stored `rejected` and refused by mds_shards.
The source runs as work units (prx_core.stages.contents) on captioner actors (one model each);
each unit looks up which of its contents are captioned already, captions the rest and writes
them as fragments (prx_core.stages.captions.units), which the driver appends in batched
commits. Failures are stored with their error and retried on the next run (the retry replaces
the failed row). The `vllm` backend runs the same units through one `ray.data.llm` pipeline
(prx_core.stages.model_pipeline), and its refused captions through a second one with the
fallback decoding.

Under the `source` captioner a content whose source has no caption is not a captioner failure:
it is stored the same way (`no_source_caption`, looked at again on the next run), counted apart
(`without_source_caption`, outside `failed`, `failures` and the coverage check's offenders) and
refused by `mds_shards` (`no_caption`). A source of which no eligible content got a caption
fails the run (`NoSourceCaptions`): it needs a VLM captioner, not a retry.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from prx_core.compute import wire
from prx_core.compute.parallel import Throttle
from prx_core.compute.units import ModelSpec, UnitRun
from prx_core.models.caption_base import SOURCE, VLLM, CaptionerConfig
from prx_core.models.captioning import CaptionBatch, no_source_captions_message
from prx_core.models.fused import FusedCaptionBatch, check_fusable
from prx_core.models.text_latents import TextLatentsConfig
from prx_core.stages.captions.report import CaptionsReport
from prx_core.stages.captions.units import (
    caption_unit,
    failed_captions,
    latent_appends,
    pending_captions,
    read_pipeline_inputs,
    read_refused,
    write_captions,
    write_retried,
)
from prx_core.stages.contents import (
    CONTENT_VOLATILE,
    UNIT_ROWS,
    commit_appends,
    model_seconds,
    model_units,
    offending_samples,
    pin_contents,
)
from prx_core.stages.model_pipeline import Retry, pipeline_units
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import lance_io, schemas
from prx_core.store.storage import Storage
from prx_core.upkeep.appends import BatchedAppend


class NoSourceCaptions(RuntimeError):
    """Under the `source` captioner, no eligible content of the source has a caption."""


def pin_captions(run: StageRun[CaptionsSettings]) -> dict[str, int]:
    """The pinned versions and units; the captioner's version (and the vLLM path, the fused encoder)
    in the manifest. Fused, the latents recorded units wrote and no commit took are appended first."""
    config = run.settings.config
    run.params["captioner_version"] = config.version()
    lance_io.upgrade_table(run.storage.lance_uri("captions"), schemas.CAPTIONS, run.storage.lance_storage_options())
    if config.backend == VLLM:
        run.params["path"] = "pipeline"
    if run.settings.fused is not None:
        check_fusable(config, run.settings.fused)
        run.params["fused_encoder_version"] = run.settings.fused.version()
        run.state["latents"] = BatchedAppend(run.storage, "text_latents", merge_rows=0)
        recorded = UnitRun.recorded(run.storage, run.stage.name, run.partition)
        run.state["latents"].commit_recorded(latent_appends(s) for s in recorded)
    return pin_contents(run, run.settings.appends or BatchedAppend(run.storage, "captions",
                                                             failed_rows=partial(failed_captions, config)))


def caption_units(run: StageRun[CaptionsSettings]) -> None:
    """Captioner actors, one model each; the `vllm` backend: one ray.data.llm pipeline (`replicas` sizes it)."""
    config = run.settings.config
    if config.backend == VLLM:
        from prx_core.models import captioning_vllm

        pipeline_units(run, prepare=partial(pending_captions, config=config),
                       read=partial(read_pipeline_inputs, config=config), write=partial(write_captions, config=config),
                       pipeline=partial(captioning_vllm.caption_dataset, config=config),
                       retry=Retry(partial(captioning_vllm.caption_dataset, config=config, fallback=True),
                                   read=partial(read_refused, config=config), write=partial(write_retried, config=config)))
    elif run.settings.fused is not None:  # one model per actor makes captions and their latents
        appends, latents = run.state["appends"], run.state["latents"]

        def on_result(summary: dict[str, Any]) -> None:
            appends.add(summary)
            latents.add(latent_appends(summary))

        run.units("units", run.state["units"], partial(caption_unit, config=config), on_result=on_result,
                  model=ModelSpec(partial(FusedCaptionBatch, config, run.settings.fused), actors=run.settings.actors))
    else:
        model_units(run, partial(caption_unit, config=config),
                    ModelSpec(partial(CaptionBatch, config), actors=run.settings.actors))


def commit_captions(run: StageRun[CaptionsSettings]) -> dict[str, int | None]:
    """The last appends: the captions, and fused, their latents (indexed like any append)."""
    versions = commit_appends(run)
    if run.settings.fused is not None:
        versions["text_latents"] = run.state["latents"].finish()
    return versions


def report_captions(run: StageRun[CaptionsSettings]) -> CaptionsReport:
    """The counts, a few offenders; refuses (`NoSourceCaptions`) a source the `source` captioner found no caption in."""
    config = run.settings.config
    results, source, appends, versions = run.results["units"], run.partition, run.state["appends"], dict(run.inputs)
    vllm = config.backend == VLLM
    report = CaptionsReport(
        source, results.total("eligible"), results.total("reused"), results.total("captioned"), results.total("failed"),
        0.0, failures=results.counts("failures"), words=results.total("words"),
        in_100_200_words=results.total("in_100_200_words"), captions_version=appends.version, read_versions=versions,
        output_tokens=results.total("output_tokens"), generation_seconds=results.seconds,
        model_seconds=model_seconds(results), commits=appends.commits, units=results,
        actors=config.replicas * config.tensor_parallel_size if vllm else run.settings.actors,
        failed_examples=[c for s in results.summaries for c in s.get("failed_examples") or []][:10])
    report.without_source_caption = results.total("without_source_caption")
    report.quality, report.fallbacks = results.counts("quality"), results.total("fallbacks")
    report.rejected_now, report.rechecked = results.total("rejected_now"), results.total("rechecked")
    rejected = [d for s in results.summaries for d in s.get("rejected_detail") or []]
    report.rejected_offenders = offending_samples(run.storage, source, rejected, versions["buckets"])
    report.latents_encoded, report.text_latents_version = results.total("encoded"), run.versions.get("text_latents")
    failed = [d for s in results.summaries for d in s.get("failed_detail") or []]
    report.offenders = offending_samples(run.storage, source, failed, versions["buckets"])
    uncaptioned = [d for s in results.summaries for d in s.get("uncaptioned_detail") or []]
    report.without_source_caption_examples = [row["sample_id"] or row["content_id"] for row in
                                              offending_samples(run.storage, source, uncaptioned, versions["buckets"])]
    if vllm:
        report.gpu_hours = report.generation_seconds * config.replicas * config.tensor_parallel_size / 3600
    report.seconds = run.seconds
    if config.backend == SOURCE and report.eligible and not report.captioned + report.reused:
        raise NoSourceCaptions(no_source_captions_message(source, report.eligible))
    return report


@dataclass(frozen=True, kw_only=True)
class CaptionsSettings(Settings):
    """The `captions` settings: the captioner (it enters the manifest as its version), actors, rows per
    unit, a shared appender (a build's stages batch their appends) and a fused latent encoder."""

    config: CaptionerConfig
    actors: int = 1
    unit_rows: int = UNIT_ROWS
    appends: BatchedAppend | None = None
    fused: TextLatentsConfig | None = None


CAPTIONS: Stage[CaptionsSettings] = Stage(
    "captions", reads=("samples", "buckets"), writes=("captions",), after=("buckets",),
    code_version="2", report_type=CaptionsReport,
    settings=CaptionsSettings,
    unit_sizes=(UnitSize("unit_rows", "Samples per `captions` unit: minutes of GPU work, so a crash loses little."),),
    # the captioner (and a fused encoder) enter as versions; actors and appends shape no output
    unpinned=("config", "actors", "appends", "fused"),
    phases=("units", "prepare"), pin=pin_captions, work=caption_units, commit=commit_captions, report=report_captions,
    volatile=CONTENT_VOLATILE,  # other sources' ingest moves them: a rerun resumes across it
    reusable=lambda report: report.failed == 0,  # failed captions are retried by the next run
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(CaptionsReport, CaptionerConfig, TextLatentsConfig)
wire.register_moved_from("prx_core.stages.captions_report", CaptionsReport)  # before the captions package


def build_captions(
    source: str, storage: Storage, config: CaptionerConfig, *, actors: int = 1, progress: Throttle | None = None,
    unit_rows: int = UNIT_ROWS, appends: BatchedAppend | None = None, fused: TextLatentsConfig | None = None,
) -> CaptionsReport:
    """`captions` of one source (`run_partition` of CAPTIONS); `appends` replaces the default batched
    appends; `fused` computes the captions' text latents on the captioner's model (transformers)."""
    return run_partition(CAPTIONS, storage, source, progress=progress, config=config, actors=actors,
                         unit_rows=unit_rows, appends=appends, fused=fused)
