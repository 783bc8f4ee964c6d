"""`prx-corpus preview`: the configured captioner (and labeller) on a few images of a source, before
anyone pays for a backfill of it.

`sample` images (default 16) are read from fragments spread over the source and kept when they
decode and get a bucket (what `captions` would caption). Each is captioned as `captions` will
caption it (`checked_captions`: the caption checks, the fallback retry), its generated tokens and
the time it took recorded (the model's first load is timed apart, on one image), and its caption
labelled (`caption_labels`' labeller) unless the caption was refused. The projection for the whole
source comes from `prx-corpus plan`'s estimate of its distinct bucketed contents (a wider sample,
metadata-sized), at the time measured here per image, and at the plan's GPU rate (`caption_rate`,
20 captions/s per H200; retries at `retry_share`). Written (optionally) to the root's
`caption_previews` table, one run per `preview_id`, with a 256 px thumbnail per image: what the
explorer's Previews page shows. Nothing of the corpus itself is read or written.
"""

from __future__ import annotations

import io
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from prx_core.image.buckets import Drop, assign_bucket
from prx_core.image.decode import DEFAULT_MAX_PIXELS, Rejection
from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.captioning import build_captioner, checked_captions
from prx_core.sources.catalog import SourceSpec
from prx_core.sources.ingest import inspect_image
from prx_core.sources.readers import fragment_sizes, read_fragment
from prx_core.stages.plan.estimates import CAPTION_RATE, RETRY_SHARE, Models, estimate
from prx_core.stages.plan.sample import sample_source, spread

SAMPLE = 16
PLAN_SAMPLE = 200  # images the projection's estimate of the source's contents reads
THUMB = 256
TABLE = "caption_previews"
SCHEMA = pa.schema([
    ("preview_id", pa.string()), ("created", pa.float64()), ("source", pa.string()), ("position", pa.int32()),
    ("source_key", pa.string()), ("thumbnail", pa.binary()), ("width", pa.int32()), ("height", pa.int32()),
    ("original_caption", pa.string()), ("captioner_id", pa.string()), ("captioner_version", pa.string()),
    ("caption", pa.string()), ("error", pa.string()), ("verdict", pa.string()), ("problem", pa.string()),
    ("attempts", pa.int32()), ("tokens", pa.int32()), ("seconds", pa.float64()), ("label", pa.string()),
    ("label_score", pa.float64()), ("summary", pa.string()),  # the run's summary (JSON), on every row
])


@dataclass
class PreviewImage:
    key: str
    data: bytes
    width: int
    height: int
    original: str | None
    caption: str | None = None
    error: str | None = None
    verdict: str = ""
    problem: str = ""
    attempts: int = 0
    tokens: int = 0
    label: str | None = None
    label_score: float | None = None


@dataclass
class PreviewSummary:
    source: str
    captioner_id: str
    captioner_version: str
    labeler: str | None
    images: int
    load_s: float  # the first call: model load and one caption
    seconds_per_image: float  # the batch of every sampled image, after the load
    tokens_per_image: float
    verdicts: dict[str, int]
    contents: int  # the plan's estimate of the source's distinct bucketed contents
    projected_hours_here: float  # contents x seconds_per_image, on this machine's device
    projected_gpu_hours: float  # contents at the plan's caption_rate per GPU, with retries
    notes: list[str] = field(default_factory=list)


def sample_images(spec: SourceSpec, count: int, storage_options: dict[str, Any] | None = None,
                  max_pixels: int = DEFAULT_MAX_PIXELS) -> list[PreviewImage]:
    """Up to `count` images that `captions` would caption (they decode and get a bucket), taken
    round-robin from fragments spread over the source."""
    picked = spread(fragment_sizes(spec, storage_options), min(count, 20))
    readers = [_records(spec, path, storage_options) for path, _ in picked]
    out: list[PreviewImage] = []
    while readers and len(out) < count:
        for reader in list(readers):
            row = next(reader, None)
            if row is None:
                readers.remove(reader)
                continue
            facts = inspect_image(row["image"] or b"", max_pixels) if not row["reject_reason"] else None
            if facts is None or isinstance(facts, Rejection) or isinstance(assign_bucket(facts.width, facts.height), Drop):
                continue
            out.append(PreviewImage(row["source_key"] or "", row["image"], facts.width, facts.height, row["caption"]))
            if len(out) == count:
                break
    return out


def _records(spec: SourceSpec, path: str, storage_options: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    try:
        for batch in read_fragment(spec, path, storage_options):
            yield from batch.select(["source_key", "image", "caption", "reject_reason"]).to_pylist()
    except Exception:  # a fragment the reader refuses: the plan and the build name it; here, other fragments
        return


def caption_images(images: list[PreviewImage], config: CaptionerConfig) -> tuple[float, float]:
    """Captions every image in place as `captions` would; returns (first-call seconds, seconds per image)."""
    captioner = build_captioner(config)
    began = time.perf_counter()
    checked_captions(captioner, [images[0].data], [images[0].original])  # loads the model
    load_s = time.perf_counter() - began
    began = time.perf_counter()
    results: list[Any] = []
    for start in range(0, len(images), max(1, config.batch_size)):
        part = images[start:start + max(1, config.batch_size)]
        results += checked_captions(captioner, [i.data for i in part], [i.original for i in part])
    per_image = (time.perf_counter() - began) / len(images)
    for image, checked in zip(images, results):
        image.caption, image.error = checked.result.caption, checked.result.error
        image.verdict, image.problem = checked.verdict, checked.problem
        image.attempts, image.tokens = checked.attempts, checked.tokens
    return load_s, per_image


def label_images(images: list[PreviewImage], config: Any) -> None:
    """The labeller's label of every shipped caption (a refused or failed one is not labelled)."""
    from prx_core.models.labels import build_labeler

    labelled = [i for i in images if i.caption and i.verdict != "rejected"]
    if not labelled:
        return
    for image, result in zip(labelled, build_labeler(config).label_batch([i.caption for i in labelled])):
        image.label, image.label_score = (result.label or None), (result.score if not result.error else None)


def preview_source(spec: SourceSpec, captioner: CaptionerConfig, labeler: Any = None, count: int = SAMPLE,
                   storage_options: dict[str, Any] | None = None, caption_rate: float = CAPTION_RATE,
                   retry_share: float = RETRY_SHARE) -> tuple[PreviewSummary, list[PreviewImage]]:
    if captioner.backend == "vllm":
        raise ValueError("the vllm captioner runs as one Ray Data pipeline over a whole run, not on a few images: "
                         "preview the same model and engine through vLLM's OpenAI server (`vllm serve <model>`, then "
                         "--config with captioner: {backend: openai, endpoint: http://host:8000/v1, model: <model>})")
    images = sample_images(spec, count, storage_options)
    if not images:
        raise ValueError(f"source {spec.name!r}: no image of the sampled fragments decodes and gets a bucket "
                         "(`prx-corpus plan` names the reject reasons)")
    load_s, per_image = caption_images(images, captioner)
    if labeler is not None:
        label_images(images, labeler)
    stats, size = sample_source(spec, max(PLAN_SAMPLE, count), storage_options)
    vlm = captioner.backend != "source"
    plan = estimate(spec.name, spec.format, stats, size, Models(vlm_captions=vlm, caption_rate=caption_rate,
                                                                retry_share=retry_share), len(spec.name))
    notes = [] if vlm else ["the `source` captioner keeps the source's captions: no model runs, nothing to pay"]
    summary = PreviewSummary(
        spec.name, captioner.captioner_id(), captioner.version(), None if labeler is None else labeler.version(),
        len(images), round(load_s, 3), round(per_image, 4), sum(i.tokens for i in images) / len(images),
        dict(Counter(i.verdict or "failed" for i in images)), plan.contents,
        plan.contents * per_image / 3600,  # the measured time includes the retries the sample needed
        plan.gpu_hours["captions"] + plan.gpu_hours["caption_retries"], notes + plan.notes)
    return summary, images


def preview_rows(summary: PreviewSummary, images: list[PreviewImage], created: float | None = None) -> pa.Table:
    """The run as `caption_previews` rows (a thumbnail per image, the summary as JSON on each)."""
    import json

    preview_id, created = uuid.uuid4().hex[:16], created or time.time()
    text = json.dumps(asdict(summary))
    rows = [{"preview_id": preview_id, "created": created, "source": summary.source, "position": n,
             "source_key": i.key, "thumbnail": thumbnail(i.data), "width": i.width, "height": i.height,
             "original_caption": i.original, "captioner_id": summary.captioner_id,
             "captioner_version": summary.captioner_version, "caption": i.caption, "error": i.error,
             "verdict": i.verdict, "problem": i.problem, "attempts": i.attempts, "tokens": i.tokens,
             "seconds": summary.seconds_per_image, "label": i.label, "label_score": i.label_score, "summary": text}
            for n, i in enumerate(images)]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def thumbnail(data: bytes, size: int = THUMB) -> bytes:
    """A small JPEG of the image (decoded safely: the sample passed ingest's validation)."""
    from prx_core.image.decode import decode_image

    decoded = decode_image(data, min_size=(size, size))
    if isinstance(decoded, Rejection):
        return b""
    image = decoded.image.convert("RGB")
    image.thumbnail((size, size))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=85)
    return out.getvalue()


def write_preview(uri: str, rows: pa.Table, storage_options: dict[str, Any] | None = None) -> None:
    import lance

    from prx_core.store import lance_io

    mode = "append" if lance_io.table_exists(uri, storage_options) else "create"
    lance.write_dataset(rows, uri, mode=mode, storage_options=storage_options or None)
