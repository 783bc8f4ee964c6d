"""How much per-sample failure the blocking data-quality checks tolerate (`checks:` in PRX_CONFIG).

A source of 100M web images always holds some samples a model cannot caption or label; one of
them must not stop the source. Each rate check passes while its failure rate (failed / checked)
is at most its threshold, with the count, the rate and up to `examples` offending samples in its
metadata, and fails (blocking what depends on it) above. The samples it counted never reach
training unnoticed: an uncaptioned sample is refused by `mds_shards` (reject `no_caption`), an
unlabelled one is skipped by `skip_lists` (reason `unlabelled`) while the policy skips labels, a
row whose sample_id repeats another is moved to `rejects` (reason `duplicate_key`) before any
stage reads the table.

The invariant checks (`buckets_in_trainer_set`, `duplicates_one_keeper`, `mds_shards_readable`)
have no threshold: a violation there is a pipeline bug, not bad input, and is exact.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field, model_validator

from prx_core.stages.contents import FAILED_EXAMPLES

MAX_EXAMPLES = FAILED_EXAMPLES  # offending samples the stages collect per check; `examples` shows at most this many
RATE_CHECKS = ("samples_unique_sample_ids", "captions_coverage", "captions_quality", "caption_labels_coverage",
               "caption_embeddings_coverage", "text_latents_coverage")


class ChecksResource(dg.ConfigurableResource):
    """Per rate check, the largest failure rate (0..1) that still passes; 0 makes it exact."""

    samples_unique_sample_ids: float = Field(
        default=0.001, ge=0, le=1,
        description="Rows whose sample_id repeats one already in the source (a key column repeated across "
                    "files): largest passing share. Below it the extra rows move to rejects (duplicate_key); "
                    "above it nothing is changed and the check blocks (fix the catalog's key).")
    captions_coverage: float = Field(
        default=0.001, ge=0, le=1,
        description="Eligible contents the captioner failed on (retried on the next run): largest passing "
                    "share. Uncaptioned samples are refused by mds_shards (no_caption). A source caption missing "
                    "under the `source` captioner is counted apart (without_source_caption), not a failure.")
    captions_quality: float = Field(
        default=0.05, ge=0, le=1,
        description="Eligible captions the caption checks refused twice (a loop, the token cap, a refusal...: "
                    "retried once with the fallback decoding, then stored as rejected and refused by mds_shards "
                    "as caption_rejected): largest share that does not fail (above it the check fails and blocks "
                    "what depends on captions).")
    captions_quality_warn: float = Field(
        default=0.01, ge=0, le=1,
        description="The share of rejected captions above which captions_quality warns (without blocking); "
                    "at most captions_quality.")
    caption_labels_coverage: float = Field(
        default=0.001, ge=0, le=1,
        description="Captioned contents without a label (a labeller error): largest passing share. "
                    "Unlabelled samples are skipped by skip_lists (unlabelled) when the policy skips labels.")
    caption_embeddings_coverage: float = Field(
        default=0.001, ge=0, le=1,
        description="Captioned contents without a caption embedding: largest passing share (explorer only).")
    text_latents_coverage: float = Field(
        default=0.001, ge=0, le=1,
        description="Captioned contents without a text latent (when text_latents is configured): largest passing "
                    "share. mds_shards refuses a sample without one (no_text_latent).")
    examples: int = Field(default=20, ge=0, le=MAX_EXAMPLES,
                          description="Offending samples listed in a rate check's metadata.")

    @model_validator(mode="before")
    @classmethod
    def known_checks(cls, values: Any) -> Any:
        """A misspelt check name would silently keep its default: refuse it, naming the valid ones."""
        if isinstance(values, dict):
            unknown = sorted(set(values) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"checks: unknown setting(s) {', '.join(unknown)}; "
                                 f"valid: {', '.join(cls.model_fields)}")
        return values

    @model_validator(mode="after")
    def warn_below_failure(self) -> "ChecksResource":
        if self.captions_quality_warn > self.captions_quality:
            raise ValueError(f"checks: captions_quality_warn ({self.captions_quality_warn}) must be at most "
                             f"captions_quality ({self.captions_quality})")
        return self

    def max_rate(self, check: str) -> float:
        if check not in RATE_CHECKS:
            raise ValueError(f"{check} is not a rate check; rate checks are {', '.join(RATE_CHECKS)}")
        return float(getattr(self, check))
