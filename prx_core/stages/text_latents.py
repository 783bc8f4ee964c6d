"""Stage `text_latents` (optional): PRX's precomputed text latents of the source's captions.

Keyed like `caption_embeddings` by (content_id, captioner version, encoder version) in the shared
`text_latents` table and computed the same way: work units over the source's eligible contents
(prx_core.stages.contents) on encoder actors (one bfloat16 model each); a unit looks its captions
and stored latents up by content_id, encodes the rest and writes fragments, appended in batched
commits. A new captioner or encoder re-encodes; a rerun, or another source sharing a content,
reuses. `mds_shards` copies the latents into each sample (`latent_caption_<preset>`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prx_core.compute import wire
from prx_core.compute.actors import ModelHost
from prx_core.compute.parallel import Throttle
from prx_core.compute.units import ModelSpec, Unit, UnitResults, UnitRun
from prx_core.models.text_latents import EncodeBatch, TextLatentsConfig, to_latent_rows
from prx_core.stages.contents import (
    CONTENT_VOLATILE,
    captioned_pending,
    commit_appends,
    model_batches,
    model_seconds,
    model_units,
    pin_contents,
    write_latents,
)
from prx_core.stages.report import StageReport
from prx_core.stages.settings import Settings
from prx_core.stages.stage import Stage, StageRun, UnitSize, run_partition
from prx_core.store import schemas
from prx_core.store.storage import Storage
from prx_core.upkeep.appends import BatchedAppend

UNIT_CONTENTS = 1024  # samples per unit: up to ~2 GB of latents at 256 tokens x 4,096 wide (an 8B model)


@dataclass
class TextLatentsReport(StageReport):
    ROWS = "captioned"
    WRITTEN = {"text_latents": "text_latents_version"}

    source: str
    captioned: int  # eligible contents with a caption
    reused: int  # of those, already encoded for (captioner, encoder)
    encoded: int
    seconds: float = 0.0
    encoding_seconds: float = 0.0  # wall time of the units (actor start and model load included)
    tokens: int = 0  # caption tokens encoded (the masks' ones)
    truncated: int = 0  # captions cut at max_tokens
    latent_bytes: int = 0  # bytes of the latents written
    text_latents_version: int | None = None
    read_versions: dict[str, int] = field(default_factory=dict)
    commits: int = 0
    units: UnitResults | None = None
    model_seconds: float = 0.0  # time the encoders spent inside the model, summed over actors

    @property
    def covered(self) -> int:  # an encoder error fails its unit: what is not covered was left out by a run
        return self.reused + self.encoded

    @property
    def latents_per_second(self) -> float:
        return self.encoded / max(self.encoding_seconds, 1e-9)


def encode_unit(host: ModelHost, unit: Unit, run: UnitRun) -> dict[str, Any]:
    """On an encoder actor: encode the unit's pending captions, write them as fragments."""
    captions, _, todo = captioned_pending(unit, run, "text_latents", "encoder_version")
    params = run.manifest.params
    outputs, seconds = model_batches(host, todo, params["batch_size"])
    rows = pa.concat_tables([schemas.TEXT_LATENTS.empty_table()]
                            + [to_latent_rows(out, params["captioner_version"]) for out in outputs])
    truncated = int(pc.sum(pc.greater_equal(rows["tokens"], params["max_tokens"])).as_py() or 0)
    return {"rows": unit.rows, "captioned": captions.num_rows, "reused": captions.num_rows - todo.num_rows,
            **write_latents(run.storage, rows), "truncated": truncated, "model_seconds": round(seconds, 4)}


def pin_latents(run: StageRun[TextLatentsSettings]) -> dict[str, int]:
    """The pinned versions and units; the encoder's version, batch size and max_tokens in the manifest.
    A unit's fragments already hold up to gigabytes, so the appends never merge them."""
    config = run.settings.config
    run.params.update(encoder_version=config.version(), batch_size=config.batch_size, max_tokens=config.max_tokens)
    return pin_contents(run, BatchedAppend(run.storage, "text_latents", merge_rows=0), follows=("captions",))


def encode_units(run: StageRun[TextLatentsSettings]) -> None:
    """Encoder actors, one model each (`gpus` per actor on a GPU cluster)."""
    settings = run.settings
    model = settings.model or ModelSpec(partial(EncodeBatch, settings.config), actors=settings.actors,
                                        num_gpus=settings.gpus)
    model_units(run, encode_unit, model)


def report_latents(run: StageRun[TextLatentsSettings]) -> TextLatentsReport:
    results = run.results["units"]
    return TextLatentsReport(
        run.partition, results.total("captioned"), results.total("reused"), results.total("encoded"),
        seconds=run.seconds, encoding_seconds=results.seconds, tokens=results.total("tokens"),
        truncated=results.total("truncated"), latent_bytes=results.total("latent_bytes"),
        text_latents_version=run.versions["text_latents"], read_versions=dict(run.inputs),
        commits=run.state["appends"].commits, units=results, model_seconds=model_seconds(results))


@dataclass(frozen=True, kw_only=True)
class TextLatentsSettings(Settings):
    """The `text_latents` settings: whose captions, the encoder (it enters as its version), actors and
    their GPUs, rows per unit and an in-process model (tests)."""

    captioner_version: str
    config: TextLatentsConfig
    actors: int = 1
    gpus: float = 0.0
    unit_rows: int = UNIT_CONTENTS
    model: ModelSpec | None = None


TEXT_LATENTS: Stage[TextLatentsSettings] = Stage(
    "text_latents", reads=("samples", "buckets", "captions"), writes=("text_latents",), after=("captions", "samples"),
    code_version="1",
    report_type=TextLatentsReport,
    settings=TextLatentsSettings,
    unit_sizes=(UnitSize("unit_rows", "Samples per `text_latents` unit: its latents are written as one fragment "
                                      "(~2 MB per caption for an 8B model), so a crash loses little."),),
    unpinned=("config", "actors", "gpus", "model"),  # the encoder enters as its version, batch size and max_tokens
    pin=pin_latents, work=encode_units, commit=commit_appends, report=report_latents,
    volatile=CONTENT_VOLATILE,  # other sources' ingest moves them: a rerun resumes across it
    reusable=lambda report: True,
)
# the classes this stage takes and reports on the wire, nested ones included, besides stage.WIRE_TYPES
WIRE_TYPES = wire.register_all(TextLatentsReport, TextLatentsConfig)


def build_text_latents(source: str, storage: Storage, captioner_version: str, config: TextLatentsConfig, *,
                       actors: int = 1, gpus: float = 0.0, progress: Throttle | None = None,
                       unit_rows: int = UNIT_CONTENTS, model: ModelSpec | None = None) -> TextLatentsReport:
    """Encode what is missing (`run_partition` of TEXT_LATENTS). `model` replaces the encoder's
    actors (a stand-in of the same output; in-process only)."""
    return run_partition(TEXT_LATENTS, storage, source, progress=progress, captioner_version=captioner_version,
                         config=config, actors=actors, gpus=gpus, unit_rows=unit_rows, model=model)
