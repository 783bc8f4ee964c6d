"""What a `captions` run reports (`CaptionsReport`): its counts, the caption checks' verdicts over
the partition, and a few offending samples; the asset's metadata and checks read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from prx_core.compute.unit_results import UnitResults
from prx_core.models.caption_checks import FLAGGED, REJECTED, RETRIED
from prx_core.stages.captions.quality import verdict_counts
from prx_core.stages.report import StageReport


@dataclass
class CaptionsReport(StageReport):
    ROWS = "eligible"
    WRITTEN = {"captions": "captions_version", "text_latents": "text_latents_version"}

    source: str
    eligible: int  # distinct caption keys: contents (a source caption: content and text)
    reused: int
    captioned: int
    failed: int  # captioner failures (retried on the next run), not contents without a source caption
    seconds: float
    failures: dict[str, int] = field(default_factory=dict)
    words: int = 0  # over the captions made by this run
    in_100_200_words: int = 0  # of those, captions of 100 to 200 words
    captions_version: int | None = None
    read_versions: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0  # generated tokens, where the backend reports them
    generation_seconds: float = 0.0  # wall time of the captioning units
    model_seconds: float = 0.0  # time the captioners spent inside the model, summed over actors
    actors: int = 1
    gpu_hours: float | None = None  # vllm: engine replicas x GPUs each x generation time
    commits: int = 0  # Lance commits of this run (batched appends, failed-row deletes)
    failed_examples: list[str] = field(default_factory=list)  # a few content_ids the captioner failed on
    offenders: list[dict[str, str]] = field(default_factory=list)  # sample_id, content_id, reason of those
    units: UnitResults | None = None
    without_source_caption: int = 0  # `source` captioner: eligible contents the source has no caption for
    without_source_caption_examples: list[str] = field(default_factory=list)  # sample_ids of a few of them
    latents_encoded: int = 0  # text_latents.fused: latents the captioners computed with their captions
    text_latents_version: int | None = None
    # the caption checks, over the partition's eligible captions after the run: "<verdict>" or
    # "<verdict>:<problem>" -> captions (captions_quality: `quality_table`, `verdict_counts`)
    quality: dict[str, int] = field(default_factory=dict)
    fallbacks: int = 0  # captions this run generated a second time with the fallback decoding
    rejected_now: int = 0  # captions this run stored as rejected (refused twice)
    rechecked: int = 0  # captions stored before the checks that failed them and were captioned again
    rejected_offenders: list[dict[str, str]] = field(default_factory=list)  # sample_id, content_id, reason (problem)

    @property
    def rejected(self) -> int:
        """Eligible captions the checks refused twice: stored, never shipped (caption_rejected)."""
        return verdict_counts(self.quality).get(REJECTED, 0)

    @property
    def retried(self) -> int:
        return verdict_counts(self.quality).get(RETRIED, 0)

    @property
    def flagged(self) -> int:
        return verdict_counts(self.quality).get(FLAGGED, 0)

    @property
    def shippable(self) -> int:
        """Eligible captions mds_shards can ship: stored, not failed, not rejected."""
        return max(self.eligible - self.missing - self.rejected, 0)

    @property
    def images_per_second(self) -> float:
        return (self.captioned + self.failed) / max(self.seconds, 1e-9)

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / max(self.generation_seconds, 1e-9)

    @property
    def missing(self) -> int:
        """Eligible contents without a caption after the run, whatever the cause."""
        return self.eligible - self.reused - self.captioned

    @property
    def captioner_missing(self) -> int:
        """Eligible contents the captioner failed on (the coverage check): the missing ones less
        those the `source` captioner had no source caption for."""
        return self.missing - self.without_source_caption

    @property
    def model_busy_fraction(self) -> float:
        """How much of the stage's wall time the captioners spent generating."""
        return self.model_seconds / max(self.seconds * self.actors, 1e-9)
