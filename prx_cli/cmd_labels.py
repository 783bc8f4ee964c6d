"""`prx-corpus eval-labels`: the configured caption labeller measured on captions labelled by hand.

The labeller is the one `build` would run: the `labeler` section of the settings (`--config`, else
$PRX_CONFIG, else the defaults), resolved by the same resource. Every caption of the file (or of
one `--split`, or of some `--round`s) is labelled by it, then prx_core.models.label_eval prints accuracy, per-class
precision and recall, the confusion matrix, the mistakes and the captions nearest each threshold.
The project's own labelled set is prx_core/models/data/labelled_captions.jsonl (`--split heldout`:
the captions the shipped head was not trained on; `--round 4`: the round written after the
others were measured, held out whole).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def add_parser(sub: Any) -> None:
    """Registers `eval-labels` on the `prx-corpus` subcommands (`sub`, from add_subparsers)."""
    cmd = sub.add_parser("eval-labels", help="measure the configured caption labeller on labelled captions: "
                                             "precision and recall per label, confusion matrix, captions nearest "
                                             "each threshold")
    cmd.add_argument("--labelled", required=True, metavar="FILE.jsonl",
                     help='JSON lines {"caption": ..., "label": "visual"|"text"|"nsfw"}, optionally with "kind" '
                          '(mistakes are counted per kind) and "split"')
    cmd.add_argument("--split", help='only the lines whose "split" is this (e.g. heldout)')
    cmd.add_argument("--round", help='only the lines whose "round" is one of these, comma-separated (e.g. 4, '
                                     'or 1,2,3)')
    cmd.add_argument("--config", help="settings YAML whose labeler section is measured, as build reads it "
                                      "(default: $PRX_CONFIG, else the default labeller)")
    cmd.add_argument("--nearest", type=int, default=5, help="captions listed nearest each threshold (default 5)")
    cmd.add_argument("--json", metavar="FILE", help="also write the evaluation as JSON to this file")
    cmd.set_defaults(func=run_eval_labels)


def run_eval_labels(args: argparse.Namespace) -> int:
    from prx_assets.settings import SettingsError, load_settings
    from prx_core.models.label_eval import LabelledFileError, evaluate, format_evaluation, label_captions, read_labelled

    if args.config:
        os.environ["PRX_CONFIG"] = os.path.abspath(args.config)
    settings = load_settings()
    config = labeler_config(settings.section("labeler"))
    try:
        labelled = read_labelled(args.labelled, args.split, args.round)
    except (OSError, LabelledFileError) as exc:
        raise SettingsError(f"--labelled: {exc}") from None
    print(f"labelling {len(labelled)} captions with {config.labeler_id()} ...", flush=True)
    uses_ray = config.backend == "llm" and config.transport == "vllm"
    if uses_ray:
        from prx_core.compute.quiet import start_ray

        start_ray(**settings.ray_start())
    try:
        results = label_captions(config, [item.caption for item in labelled])
    finally:
        if uses_ray:
            import ray

            ray.shutdown()
    evaluation = evaluate(labelled, results, config, nearest=args.nearest)
    where = ", ".join([f"split {args.split}"] * bool(args.split) + [f"round {args.round}"] * bool(args.round))
    print(format_evaluation(evaluation, args.labelled + (f" ({where})" if where else "")))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"labelled": args.labelled, "split": args.split, "round": args.round, **evaluation.to_json()},
                      out, indent=1)
        print(f"evaluation written to {args.json}")
    return 0


def labeler_config(section: dict[str, Any]) -> Any:
    """The LabelerConfig a build would use for this `labeler` settings section."""
    from prx_assets.settings import SettingsError
    from prx_resources.models import LabelerResource

    try:
        return LabelerResource(**section).config()
    except ValueError as exc:  # pydantic's ValidationError included
        raise SettingsError(f"labeler settings: {exc}") from None
