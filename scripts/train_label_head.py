"""Trains the `minilm` labeller's head (prx_core/models/data/label_head.json) from the train split
of prx_core/models/data/labelled_captions.jsonl; deterministic (prx_core.models.label_head_train).

    .venv/bin/python scripts/train_label_head.py [--out FILE]

The held-out split is never read here: measure the result with
`prx-corpus eval-labels --labelled prx_core/models/data/labelled_captions.jsonl --split heldout`
(`--round 1,2,3`: the hash-split rounds; `--round 8`: the fresh round held out whole).
Training is ~3 minutes on 2 cores (4 word scales x 6 penalties x 3 x 5 folds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    from prx_core.models.embeddings import embed_captions, model_identity
    from prx_core.models.label_base import LABELS
    from prx_core.models.label_head import HEAD_PATH, LABELLED_PATH, labelled_rows, write_head
    from prx_core.models.label_head_train import train_head

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(HEAD_PATH), help=f"where the head is written (default {HEAD_PATH})")
    args = parser.parse_args()
    rows = labelled_rows(LABELLED_PATH, split="train")
    started = time.time()
    vectors = embed_captions([r["caption"] for r in rows], batch_size=32, device="cpu")
    print(f"embedded {len(rows)} training captions in {time.time() - started:.0f} s", flush=True)
    head, per_l2 = train_head(rows, vectors, LABELS, model_identity(), LABELLED_PATH.relative_to(REPO).as_posix())
    print("out-of-fold, mean of the repeats: the best thresholds per word scale and penalty")
    print("words  l2        cost     accuracy  text thr  nsfw thr  explicit missed  photo->text")
    for c in per_l2:
        mark = "  <- chosen" if (c.word_scale, c.l2) == (head.word_scale, head.meta["l2"]) else ""
        print(f"{c.word_scale:<6g} {c.l2:<9g} {c.cost:<8.2f} {c.accuracy:<9.4f} {c.text_threshold:<9} "
              f"{c.nsfw_threshold:<9} {c.missed_nsfw:<16.2f} {c.photo_to_text:.2f}{mark}")
    write_head(head, Path(args.out))
    print(f"wrote {args.out} (digest {head.digest()[:12]}) in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
