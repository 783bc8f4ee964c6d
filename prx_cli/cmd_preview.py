"""`prx-corpus preview`: look before you pay. The configured captioner (and labeller) on a few
sampled images of one source (prx_core.stages.preview), printed image by image with tokens, time,
the caption checks' verdicts and the label, then the projection for the whole source; with
`--root`, also saved to the root's `caption_previews` table, which the explorer's Previews page shows.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from typing import Any

CAPTION_CHARS = 240


def add_parser(sub: Any) -> None:
    """Registers `preview` on the `prx-corpus` subcommands (`sub`, from add_subparsers)."""
    preview = sub.add_parser("preview", help="the configured captioner and labeller on a few images of a source, "
                                             "with tokens, time, caption verdicts and the GPU-hours of the whole source")
    preview.add_argument("--sources", required=True, help="the sources.yaml catalog")
    preview.add_argument("--source", required=True, help="the source to preview")
    preview.add_argument("--config", help="PRX_CONFIG settings: the captioner and labeler to preview")
    preview.add_argument("--sample", type=int, default=16, help="images captioned (default 16)")
    preview.add_argument("--root", help="also save the preview under this corpus root, for the explorer's Previews page")
    preview.add_argument("--no-labels", action="store_true", help="caption only")
    preview.add_argument("--caption-rate", type=float, default=None,
                         help="VLM captions per second per GPU for the projection (default 20, an H200's)")
    preview.add_argument("--json", help="also write the preview (summary and captions) as JSON to this file")
    preview.add_argument("--no-preflight", action="store_true", help="skip `build`'s checks of the source")
    preview.set_defaults(func=run_preview)


def run_preview(args: argparse.Namespace) -> int:
    from prx_cli.cmd_plan import preflight_sources
    from prx_assets.settings import SettingsError, load_settings
    from prx_core.sources.catalog import load_catalog
    from prx_core.stages.plan.estimates import CAPTION_RATE
    from prx_core.stages.preview import TABLE, preview_rows, preview_source, write_preview
    from prx_core.store.storage import Storage
    from prx_resources.models import CaptionerResource, LabelerResource

    if not 1 <= args.sample <= 1000:
        raise SettingsError(f"--sample: from 1 to 1000 images, got {args.sample}")
    if args.config:
        os.environ["PRX_CONFIG"] = os.path.abspath(args.config)
    settings = load_settings()
    catalog = load_catalog(os.path.abspath(args.sources))
    if args.source not in catalog.names:
        raise SettingsError(f"--source: {args.source} not in {args.sources} (sources: {', '.join(catalog.names)})")
    spec = catalog.get(args.source)
    options = settings.section("storage").get("storage_options") or {}
    if not args.no_preflight and preflight_sources(catalog.path, [spec], settings):
        return 2
    captioner = CaptionerResource(**settings.section("captioner")).config()
    labeler = None if args.no_labels else LabelerResource(**settings.section("labeler")).config()
    print(f"previewing {spec.name} ({spec.format}, {spec.uri}) with {captioner.captioner_id()} on {args.sample} images ...",
          flush=True)
    try:
        summary, images = preview_source(spec, captioner, labeler, args.sample, options,
                                         caption_rate=args.caption_rate or CAPTION_RATE)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    for line in image_lines(images):
        print(line)
    for line in summary_lines(summary, args.caption_rate or CAPTION_RATE):
        print(line)
    if args.root:
        storage = Storage(args.root, options)
        write_preview(storage.lance_uri(TABLE), preview_rows(summary, images), storage.lance_storage_options())
        print(f"saved to {storage.lance_uri(TABLE)}: `prx-corpus browse --root {args.root}`, then /previews?source={spec.name}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"summary": asdict(summary), "images": [{k: v for k, v in asdict(i).items() if k != "data"}
                                                              for i in images]}, out, indent=1)
        print(f"preview written to {args.json}")
    return 0


def image_lines(images: list[Any]) -> list[str]:
    """Per image: key and size, verdict (problem), tokens, label; then its caption, indented."""
    lines = []
    for n, image in enumerate(images, 1):
        verdict = image.verdict or "failed"
        problem = f" ({image.problem})" if image.problem else ""
        label = f", label {image.label} {image.label_score:.2f}" if image.label and image.label_score is not None else ""
        lines.append(f"[{n}] {image.key} {image.width}x{image.height}: {verdict}{problem}, {image.tokens} tokens"
                     f"{f', {image.attempts} generations' if image.attempts > 1 else ''}{label}")
        text = image.caption if image.caption is not None else f"(no caption: {image.error})"
        flat = " ".join(text.split())
        lines.append("    " + (flat if len(flat) <= CAPTION_CHARS else flat[:CAPTION_CHARS - 3] + "..."))
    return lines


def summary_lines(summary: Any, caption_rate: float) -> list[str]:
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(summary.verdicts.items(), key=lambda kv: -kv[1]))
    lines = ["", f"{summary.captioner_id}: {summary.images} images; first call {summary.load_s:.1f} s (loads the model), "
                 f"then {summary.seconds_per_image:.3g} s and {summary.tokens_per_image:.0f} generated tokens per image; "
                 f"caption checks: {verdicts}"]
    lines.append(f"the whole source: ~{summary.contents:,} captions; ~{summary.projected_hours_here:.3g} h at the time "
                 f"measured here; ~{summary.projected_gpu_hours:.3g} GPU-hours at {caption_rate:g} captions/s per GPU "
                 "(--caption-rate), retries included")
    lines += [f"note: {note}" for note in summary.notes]
    return lines
