"""The arithmetic of `prx-corpus plan`: a source's sample (prx_core.stages.plan.sample) scaled to its
size, then rows, MDS streams and bytes, storage, GPU-hours, core-hours and wall time.

Rates that a sample of 1,000 images cannot measure are constants, each from a measurement: the
per-row costs of the stages beyond their image work (prx-bench scale at 100,000 rows,
docs/benchmarks.md: `samples` 3.5 core-ms per image of which the validating decode measured
here is ~2.7, `mds_shards` 9.0 of which the render is ~6.5, the other stages whole), a VLM's
captions per second per GPU (the source team's 20 images/s per H200, `caption_rate`), the share of
captions the caption checks refuse and generate again with the fallback decoding (`retry_share`:
assumed 5%, the share of rejected captions at which `captions_quality` fails; a captions run's
`fallbacks` / `eligible` measures it), and a labeller's 200 captions/s per GPU (vLLM) or 23 per
core (MiniLM, measured here).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from prx_core.shards.mds.streams import SIZE_LIMIT
from prx_core.sources.catalog import SourceSpec
from prx_core.stages.plan.machine import Prices
from prx_core.stages.plan.sample import SAMPLE, Bucketed, SampleStats, SourceSize, sample_source
from prx_core.stages.samples.refusals import GENERIC_HINT, fix_for
from prx_core.upkeep.compaction import TARGET_BYTES

ROW_MS = {"samples": 0.8, "buckets": 0.05, "phashes": 0.04, "captions": 0.33, "mds_shards": 2.5,
          "skip_lists": 0.25, "compact_corpus": 0.7}  # core-ms per row beyond the measured image work
CAPTION_RATE = 20.0  # VLM captions per second per GPU (H200)
RETRY_SHARE = 0.05  # captions generated twice (the caption checks refused the first answer): assumed
LABEL_RATE_GPU, LABEL_RATE_CORE = 200.0, 23.0  # captions labelled per second
VLM_CAPTION_BYTES = 1_000  # a 100-200 word caption
MDS_SAMPLE_OVERHEAD = 100  # bytes per MDS sample beside image and captions (ints, ids, offsets)
TABLE_ROW_BYTES = {"samples": 400, "rejects": 300, "buckets": 120, "phashes": 110, "captions": 1_200,
                   "caption_labels": 120, "caption_embeddings": 1_650, "mds_index": 150}  # without image bytes
FRAGMENT_ROWS = 1_000_000
VLM_CAPTION_WORDS = 150  # the caption prompt asks for 100-200 words
BF16_HEADER, MASK_HEADER = 12, 16  # a 2-D `bf16` encoding's ndim and shape; the `ndarray` mask's dtype and shape
LATENT_ROW_BYTES = 150  # a `text_latents` row beside its latent: ids, versions, counts
REJECT_REASONS = 3  # reject reasons shown per source
PLAN_GENERIC_FIX = "the example's message says why; a build keeps every refused row in rejects.lance"


@dataclass
class LatentSizing:
    """What decides a text latent's bytes (text_latents configured): the encoder's width, the preset's
    max_tokens, masks, and its tokenizer's tokens per word (prx_core.models.text_latents.latent_sizing)."""

    hidden: int
    max_tokens: int
    masks: bool
    tokens_per_word: float

    def latent_bytes(self, words: float) -> float:
        """A caption's latent as stored: its tokens with masks, else every max_tokens row."""
        rows = min(self.max_tokens, max(1, round(words * self.tokens_per_word))) if self.masks else self.max_tokens
        return BF16_HEADER + rows * self.hidden * 2

    def mds_bytes(self, words: float) -> float:
        return self.latent_bytes(words) + (MASK_HEADER + self.max_tokens if self.masks else 0)


@dataclass
class Models:
    """The models a build would run: whether captions and labels take GPUs, and their rates."""

    vlm_captions: bool = False  # a VLM re-captions (not the `source` captioner)
    gpu_labels: bool = False  # labels by an LLM on vLLM (else MiniLM on CPUs)
    caption_rate: float = CAPTION_RATE
    retry_share: float = RETRY_SHARE  # captions the checks refuse and generate once more (fallback decoding)
    batch_size: int = 256  # training.global_batch_size: a stream smaller than one batch is unusable
    latents: LatentSizing | None = None  # text_latents configured: stored in the table and in every MDS sample
    engines: str = ""  # the vLLM captioner: how its engines are sized (prx_core.models.engine_sizing), one line


@dataclass
class SourcePlan:
    source: str
    format: str
    sampled: int
    fragments: int
    bytes: int
    rows: int
    rows_from: str
    rejected: int
    dropped: dict[str, int]
    bucketed: int
    captioned_share: float  # of records read: a non-empty source caption
    mean_caption_words: float
    mds_samples: int  # what mds_shards writes: bucketed, and with a caption when captions are the source's
    contents: int  # distinct bucketed contents: what a VLM captions
    streams: dict[str, int]  # "<tier>/<w>x<h>" -> samples
    small_streams: list[str]  # fewer samples than one global batch
    mds_bytes: int
    mds_shards: int
    storage_bytes: dict[str, int]
    table_fragments: dict[str, int]
    gpu_hours: dict[str, float]
    core_hours: dict[str, float]
    image_ms: dict[str, float]  # measured per image on this machine: validate (samples), render (mds)
    notes: list[str] = field(default_factory=list)
    # the dominant reject reasons, most first: reason, sampled, rows (scaled), example {key, message}, fix
    rejects: list[dict[str, Any]] = field(default_factory=list)


def estimate(source: str, fmt: str, stats: SampleStats, size: SourceSize, models: Models,
             source_name_bytes: int = 16) -> SourcePlan:
    """The source's plan: every count is the sample's share times the rows."""
    n = max(stats.read, 1)
    rows = size.rows if size.rows is not None else round(size.bytes * stats.read / max(stats.record_bytes, 1))
    scale = rows / n
    written = [b for b in stats.bucketed if models.vlm_captions or b.captioned]  # what mds_shards stores
    streams = {k: round(v * scale) for k, v in sorted(Counter(b.bucket for b in written).items())}
    per_sample = mds_sample_bytes(written, models.vlm_captions) + MDS_SAMPLE_OVERHEAD + 2 * source_name_bytes
    words = VLM_CAPTION_WORDS if models.vlm_captions else stats.caption_words / max(stats.captions, 1)
    if models.latents is not None:
        per_sample += models.latents.mds_bytes(words)
    mds_samples, bucketed = round(len(written) * scale), round(len(stats.bucketed) * scale)
    contents = round(len({b.content for b in stats.bucketed}) * scale)
    rejected = round(sum(stats.rejected.values()) * scale)
    ingested, image_bytes = rows - rejected, stats.record_bytes / n
    storage = {"samples": round(ingested * (image_bytes + TABLE_ROW_BYTES["samples"])),
               "rejects": rejected * TABLE_ROW_BYTES["rejects"], "mds": round(mds_samples * per_sample),
               **{t: ingested * TABLE_ROW_BYTES[t] for t in ("buckets", "phashes")},
               **{t: contents * TABLE_ROW_BYTES[t] for t in ("captions", "caption_labels", "caption_embeddings")},
               "mds_index": mds_samples * TABLE_ROW_BYTES["mds_index"]}
    if models.latents is not None:
        storage["text_latents"] = round(contents * (models.latents.latent_bytes(words) + LATENT_ROW_BYTES))
    fragments = {t: max(1, math.ceil(ingested / FRAGMENT_ROWS)) for t in ("buckets", "phashes", "mds_index")}
    fragments["samples"] = max(fragments["buckets"], math.ceil(storage["samples"] / TARGET_BYTES))
    validate_ms = 1000 * stats.inspect_s / max(stats.decoded, 1)
    render_ms = 1000 * stats.render_s / max(len(stats.bucketed), 1)
    core_ms = {"samples": rows * (validate_ms + ROW_MS["samples"]),
               "mds_shards": mds_samples * (render_ms + ROW_MS["mds_shards"]),
               **{s: ingested * ROW_MS[s] for s in ("buckets", "phashes", "skip_lists", "compact_corpus")},
               "captions": bucketed * ROW_MS["captions"]}
    gpu = {"captions": contents / models.caption_rate / 3600 if models.vlm_captions else 0.0,
           "caption_retries": contents * models.retry_share / models.caption_rate / 3600 if models.vlm_captions else 0.0,
           "caption_labels": contents / LABEL_RATE_GPU / 3600 if models.gpu_labels else 0.0}
    if not models.gpu_labels:
        core_ms["caption_labels"] = contents * 1000 / LABEL_RATE_CORE
    notes = [] if stats.read else ["no record could be read: every estimate is 0"]
    if models.vlm_captions:
        notes.append(f"caption checks: ~{models.retry_share:.1%} of {contents:,} captions generated again with the "
                     f"fallback decoding: {gpu['caption_retries']:.3g} of its {gpu['captions'] + gpu['caption_retries']:.3g} "
                     "captioning GPU-hours (--retry-share: a captions run's fallbacks / eligible)")
    if models.latents is not None:
        notes.append(f"text latents: ~{models.latents.latent_bytes(words):,.0f} bytes per caption of ~{words:.0f} "
                     "words, in the table and again in MDS; their GPU time is not estimated (no measured rate)")
    if size.rows is None:
        notes.append(f"rows estimated from {size.bytes:,} listed bytes at {image_bytes:,.0f} bytes per sampled record")
    return SourcePlan(
        source=source, format=fmt, sampled=stats.read, fragments=size.fragments, bytes=size.bytes, rows=rows,
        rows_from=size.rows_from, rejected=rejected, dropped={k: round(v * scale) for k, v in sorted(stats.dropped.items())},
        bucketed=bucketed, captioned_share=stats.captions / n,
        mean_caption_words=stats.caption_words / max(stats.captions, 1), mds_samples=mds_samples, contents=contents,
        streams=streams, small_streams=[k for k, v in streams.items() if v < models.batch_size],
        mds_bytes=storage["mds"], mds_shards=sum(math.ceil(c * per_sample / SIZE_LIMIT) for c in streams.values()),
        storage_bytes=storage, table_fragments=fragments, gpu_hours=gpu,
        core_hours={k: v / 3_600_000 for k, v in core_ms.items()},
        image_ms={"validate": round(validate_ms, 2), "render": round(render_ms, 2)}, notes=notes,
        rejects=reject_reasons(stats, scale, fmt))


def reject_reasons(stats: SampleStats, scale: float, fmt: str, top: int = REJECT_REASONS) -> list[dict[str, Any]]:
    """The sample's most frequent reject reasons, each with its first example and the likely fix
    (`samples.refusals`' table, the one a build's refused source names)."""
    ranked = sorted(stats.rejected.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    out = []
    for reason, count in ranked:
        fix = fix_for(reason, fmt)
        out.append({"reason": reason, "sampled": count, "rows": round(count * scale),
                    "example": stats.examples.get(reason) or {},
                    "fix": PLAN_GENERIC_FIX if fix == GENERIC_HINT else fix})
    return out


def mds_sample_bytes(written: list[Bucketed], vlm_captions: bool) -> float:
    """Mean image and caption bytes of an MDS sample: the rendered JPEG, the caption (a VLM's, or
    the source's again) and the original caption."""
    if not written:
        return 0.0
    captions = sum(VLM_CAPTION_BYTES + b.caption_bytes if vlm_captions else 2 * b.caption_bytes for b in written)
    return (sum(b.jpeg_bytes for b in written) + captions) / len(written)


@dataclass
class CorpusPlan:
    sources: list[SourcePlan]
    cpus: int
    gpus: int
    machine: str = ""  # what the wall time is for (prx_core.stages.plan.machine): this machine, a cluster, given
    prices: Prices | None = None
    engines: str = ""  # Models.engines

    def totals(self) -> dict[str, float]:
        core = sum(sum(p.core_hours.values()) for p in self.sources)
        gpu = sum(sum(p.gpu_hours.values()) for p in self.sources)
        stored = sum(sum(p.storage_bytes.values()) for p in self.sources)
        costs = self.prices.cost(gpu, core, stored) if self.prices and self.prices.given() else {}
        return {"rows": sum(p.rows for p in self.sources), "mds_samples": sum(p.mds_samples for p in self.sources),
                "storage_bytes": stored, "mds_bytes": sum(p.mds_bytes for p in self.sources), "core_hours": core,
                "gpu_hours": gpu, **{f"cost_{k}": v for k, v in costs.items()},
                # the CPU stages and the GPU stages of a source run one after the other
                "wall_hours": core / max(self.cpus, 1) + (gpu / self.gpus if self.gpus else (math.inf if gpu else 0.0))}

    def to_json(self) -> dict[str, Any]:
        return {"cpus": self.cpus, "gpus": self.gpus, "machine": self.machine, "engines": self.engines,
                "prices": asdict(self.prices) if self.prices else None,
                "sources": [asdict(p) for p in self.sources], "totals": self.totals()}


def plan_corpus(specs: list[SourceSpec], models: Models, sample: int = SAMPLE, cpus: int = 64, gpus: int = 8,
                storage_options: dict[str, Any] | None = None, echo: Any = None, machine: str = "",
                prices: Prices | None = None) -> CorpusPlan:
    """Each source sampled and estimated in turn (`echo`, if given, hears which one)."""
    plans = []
    for spec in specs:
        if echo is not None:
            echo(f"sampling {spec.name} ({spec.format}, {spec.uri}) ...")
        stats, size = sample_source(spec, sample, storage_options)
        plans.append(estimate(spec.name, spec.format, stats, size, models, source_name_bytes=len(spec.name)))
    return CorpusPlan(plans, cpus, gpus, machine or f"{cpus} cores, {gpus} GPUs", prices, models.engines)


def format_plan(plan: CorpusPlan) -> str:
    """The printed plan: one row per source, then the totals and each source's notes."""
    lines = ["| source | rows | rejected | below floor / aspect | MDS samples | streams (small) | MDS | stored | "
             "GPU-h | core-h | validate / render ms |", "|" + "---|" * 11]
    for p in plan.sources:
        dropped = f"{p.dropped.get('below_floor', 0):,} / {p.dropped.get('aspect_ratio', 0):,}"
        lines.append(f"| {p.source} | {p.rows:,} | {p.rejected:,} | {dropped} | {p.mds_samples:,} | "
                     f"{len(p.streams)} ({len(p.small_streams)}) | {size(p.mds_bytes)} | {size(sum(p.storage_bytes.values()))} | "
                     f"{sum(p.gpu_hours.values()):.3g} | {sum(p.core_hours.values()):.3g} | "
                     f"{p.image_ms['validate']:.1f} / {p.image_ms['render']:.1f} |")
    t = plan.totals()
    wall = (f"none: no GPU there for its {t['gpu_hours']:.3g} GPU-hours (give --gpus, or ray.address a cluster's)"
            if math.isinf(t["wall_hours"]) else f"{t['wall_hours']:.3g} h")
    lines += ["", f"total: {t['rows']:,.0f} rows, {t['mds_samples']:,.0f} MDS samples, {size(t['mds_bytes'])} of MDS, "
              f"{size(t['storage_bytes'])} stored, {t['gpu_hours']:.3g} GPU-hours, {t['core_hours']:.3g} core-hours; "
              f"wall time on {plan.machine}: {wall}"]
    if "cost_compute" in t and plan.prices:
        c, p = plan.prices.currency, plan.prices
        lines.append(f"cost at {c}{p.gpu_hour:g}/GPU-hour, {c}{p.cpu_hour:g}/core-hour, {c}{p.gb_month:g}/GB-month: "
                     f"{c}{t['cost_compute']:,.2f} to build (GPU {c}{t['cost_gpu']:,.2f}, CPU {c}{t['cost_cpu']:,.2f}), "
                     f"then {c}{t['cost_storage_per_month']:,.2f} a month to keep {size(t['storage_bytes'])}")
    if plan.engines:
        lines.append(f"captioning: {plan.engines}")
    for p in plan.sources:
        lines += [f"{p.source}: {note}" for note in p.notes]
        lines += reject_lines(p)
        if p.small_streams:
            lines.append(f"{p.source}: {len(p.small_streams)} of {len(p.streams)} streams hold fewer samples than one "
                         f"global batch: {', '.join(p.small_streams[:6])}{' ...' if len(p.small_streams) > 6 else ''}")
    return "\n".join(lines)


def reject_lines(p: SourcePlan) -> list[str]:
    """`src: rejects path_outside_source 12 of 12 sampled, e.g. k3: "..."; fix: ...` per dominant reason."""
    lines = []
    for r in p.rejects:
        example = r["example"]
        shown = f", e.g. {example['key']}: \"{example['message']}\"" if example else ""
        lines.append(f"{p.source}: rejects {r['reason']} {r['sampled']} of {p.sampled} sampled (~{r['rows']:,} rows)"
                     f"{shown}; fix: {r['fix']}")
    return lines


def size(n: float) -> str:
    """Bytes for people: 812 kB, 3.4 GB, 1.2 PB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"
