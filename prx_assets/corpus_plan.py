"""Asset `corpus_plan` (global, never automatic): what building every catalog source will cost,
from a sample of each (`prx-corpus plan` in the UI). Materialize it before a backfill; it writes
nothing under the root, its metadata is the plan."""


import dagster as dg
from dagster_ray import RayResource
from pydantic import Field

from prx_assets.common import GROUP, OWNERS, md_table
from prx_core.models.caption_base import VLLM
from prx_core.models.engine_sizing import describe_sizing
from prx_core.models.text_latents import latent_sizing
from prx_core.sources.preflight import check_source
from prx_core.stages.plan.estimates import (CAPTION_RATE, RETRY_SHARE, LatentSizing, Models, format_plan, plan_corpus,
                                            reject_lines)
from prx_core.stages.plan.machine import Machine, Prices
from prx_resources import (
    CaptionerResource,
    CatalogResource,
    LabelerResource,
    StorageResource,
    TextLatentsResource,
    TrainingResource,
)

DESCRIPTION = ("What a build of every catalog source will cost, estimated from a sample of each (1,000 images by "
               "default) read on Ray workers: rows, rejects, MDS samples and streams (and those smaller than one "
               "global batch), bytes per table, GPU-hours, core-hours and the wall time for a cluster. Never "
               "automatic; materialize it before a backfill. Writes nothing.")


class PlanConfig(dg.Config):
    sample: int = Field(default=1_000, ge=1, description="Images read per source.")
    cpus: int | None = Field(default=None, ge=1, description="Cores for the wall time (default: the Ray cluster's).")
    gpus: int | None = Field(default=None, ge=0, description="GPUs for the wall time (default: the Ray cluster's).")
    gpu_hour_price: float = Field(default=0.0, ge=0, description="Price of a GPU-hour (0: no cost shown).")
    cpu_hour_price: float = Field(default=0.0, ge=0, description="Price of a core-hour.")
    gb_month_price: float = Field(default=0.0, ge=0, description="Price of a GB stored for a month.")
    caption_rate: float = Field(default=CAPTION_RATE, gt=0, description="VLM captions per second per GPU.")
    retry_share: float = Field(default=RETRY_SHARE, ge=0, le=1,
                               description="VLM captions the caption checks refuse and generate again (fallback decoding).")


def models_of(captioner: CaptionerResource, labeler: LabelerResource, training: TrainingResource,
              latents: TextLatentsResource, caption_rate: float = CAPTION_RATE) -> Models:
    """The models a build would run, as the resources configure them."""
    config = latents.config()
    sizing = None
    if config is not None:
        hidden, per_word = latent_sizing(config)
        sizing = LatentSizing(hidden, config.max_tokens, config.masks, per_word)
    engines = describe_sizing(captioner.config()) if captioner.backend == VLLM else ""
    return Models(vlm_captions=captioner.backend != "source", gpu_labels=labeler.uses_gpus(), caption_rate=caption_rate,
                  batch_size=training.global_batch_size, latents=sizing, engines=engines)


def cluster_machine(cpus: int | None, gpus: int | None) -> Machine:
    """The given counts, else the Ray cluster this run's Ray is (embedded or connected): its resources."""
    import ray

    if cpus is not None and gpus is not None:
        return Machine(cpus, gpus, "given (run config)")
    resources = ray.cluster_resources() if ray.is_initialized() else {}
    return Machine(cpus if cpus is not None else int(resources.get("CPU", 1)),
                   gpus if gpus is not None else int(resources.get("GPU", 0)), "the run's Ray cluster")


def digits(hours: float) -> float:
    """Four significant digits: a demo's 0.0039 hours is not 0."""
    return float(f"{hours:.4g}")


@dg.asset(group_name=GROUP, kinds={"ray"}, code_version="1", description=DESCRIPTION, owners=OWNERS)
def corpus_plan(context: dg.AssetExecutionContext, config: PlanConfig, catalog: CatalogResource,
                storage: StorageResource, captioner: CaptionerResource, labeler: LabelerResource,
                training: TrainingResource, text_latents: TextLatentsResource, ray: RayResource) -> dg.MaterializeResult:
    models = models_of(captioner, labeler, training, text_latents, config.caption_rate)
    models.retry_share = config.retry_share
    specs = list(catalog.load().sources)
    problems = [p.line() for spec in specs for p in check_source(spec, storage.storage().storage_options)]
    if problems:  # `build`'s preflight: one line per problem, before any image is read
        raise dg.Failure(description="\n".join(problems), metadata={"problems": len(problems)})
    machine = cluster_machine(config.cpus, config.gpus)
    prices = Prices(config.gpu_hour_price, config.cpu_hour_price, config.gb_month_price)
    plan = plan_corpus(specs, models, config.sample, machine.cpus, machine.gpus,
                       storage.storage().storage_options, echo=context.log.info, machine=machine.describe(),
                       prices=prices if prices.given() else None)
    totals = plan.totals()
    rows = [{"source": p.source, "rows": p.rows, "rejected": p.rejected, "mds_samples": p.mds_samples,
             "streams": len(p.streams), "small_streams": len(p.small_streams), "mds_gb": round(p.mds_bytes / 1e9, 3),
             "gpu_hours": digits(sum(p.gpu_hours.values())), "core_hours": digits(sum(p.core_hours.values()))}
            for p in plan.sources]
    context.log.info(format_plan(plan))
    return dg.MaterializeResult(metadata={
        "plan": md_table(rows), "sources": len(plan.sources), "dagster/row_count": int(totals["rows"]),
        "mds_samples": int(totals["mds_samples"]), "gpu_hours": dg.MetadataValue.float(digits(totals["gpu_hours"])),
        "core_hours": dg.MetadataValue.float(digits(totals["core_hours"])),
        "wall_hours": dg.MetadataValue.float(digits(totals["wall_hours"])) if totals["wall_hours"] != float("inf")
        else dg.MetadataValue.text("no GPU given"),
        "mds_bytes": int(totals["mds_bytes"]), "stored_bytes": int(totals["storage_bytes"]),
        **({"cost_to_build": dg.MetadataValue.float(round(totals["cost_compute"], 2)),
            "cost_per_month": dg.MetadataValue.float(round(totals["cost_storage_per_month"], 2))}
           if "cost_compute" in totals else {}),
        "cluster": machine.describe(), "notes": "\n".join(
            f"{p.source}: {n}" for p in plan.sources for n in p.notes) or "-",
        "rejects": "\n".join(line for p in plan.sources for line in reject_lines(p)) or "-"})
