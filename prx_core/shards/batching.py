"""What each stream contributes to an epoch under streaming's batching, and warnings that name streams.

`CorpusDataset` (prx_core.shards.loader) leaves out, before streaming sees them, the streams
streaming's per_stream / device_per_stream batching would raise on (fewer samples per epoch than
one global batch), and says so in ONE warning naming each stream and why. Streaming itself then
drops every stream's incomplete last batch each epoch, logging "stream with index N" once per
stream; `naming_dropped_batches` turns those lines into one warning naming the streams
(`<source>/<tier>/<w>x<h>`). That drop is why an epoch yields fewer samples than `len(dataset)`:
with one rank and batch size B, a kept stream of n samples yields floor(n / B) * B of them.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
from streaming import Stream
from streaming.base.util import number_abbrev_to_int
from streaming.base.world import World

if TYPE_CHECKING:
    from prx_core.shards.manifest import StreamPlan

BATCHING_LOGGERS = ("streaming.base.batching.per_stream", "streaming.base.batching.device_per_stream",
                    "streaming.base.batching.stratified")
_INDEX = re.compile(r"stream with index (\d+)", re.I)
MAX_NAMED = 20  # streams named in one warning; the rest are counted


def min_stream_samples(kwargs: Mapping[str, Any]) -> int:
    """Fewest samples a stream needs so streaming's batching can build one full batch of it."""
    batch_size, method = kwargs.get("batch_size"), kwargs.get("batching_method")
    if not isinstance(batch_size, int):
        return 1
    world = World.detect()
    if kwargs.get("replication"):
        world = world.replicate(int(kwargs["replication"]))
    if method == "per_stream":  # one global batch: each rank's partition must hold batch_size
        return batch_size * world.num_ranks
    if method == "device_per_stream":  # one device batch per node
        return batch_size * world.num_nodes
    return 1


def chooses(counts: Sequence[int], weights: Sequence[float] | None, epoch_size: Any, seed: int) -> list[int]:
    """Samples per stream per epoch, computed by streaming's own `Stream.apply_weights`."""
    fakes = [SimpleNamespace() if weights is None else SimpleNamespace(proportion=w)
             for w in (weights or [None] * len(counts))]
    size = number_abbrev_to_int(epoch_size) if epoch_size else None
    Stream.apply_weights(fakes, np.asarray(counts, np.int64), size, seed)  # type: ignore[arg-type]
    return [int(f.choose) for f in fakes]


def stream_weights(plans: Sequence[StreamPlan], proportions: Mapping[str, float] | None) -> list[float] | None:
    """A source's proportion split over its streams by stored sample count (as PRX does)."""
    if proportions is None:
        return None
    totals: dict[str, int] = {}
    for p in plans:
        totals[p.source] = totals.get(p.source, 0) + p.count
    return [float(proportions[p.source]) * p.count / totals[p.source] for p in plans]


def usable_streams(plans: Sequence[StreamPlan], proportions: Mapping[str, float] | None,
                   kwargs: Mapping[str, Any]) -> tuple[list[StreamPlan], dict[str, str]]:
    """The streams streaming can batch, and why each other one is left out (name -> reason):
    every sample skipped, or fewer samples per epoch than one batch (streaming would raise).
    Leaving a stream out changes the others' share of `epoch_size`, hence the loop."""
    left_out = {p.name: "every sample is skipped" for p in plans if len(p.skipped) == p.count}
    kept = [p for p in plans if p.name not in left_out]
    need, seed = min_stream_samples(kwargs), int(kwargs.get("shuffle_seed", 9176))
    while kept:
        per_epoch = chooses([p.count for p in kept], stream_weights(kept, proportions), kwargs.get("epoch_size"), seed)
        small = {p.name: c for p, c in zip(kept, per_epoch) if c < need}
        if not small:
            break
        left_out.update({name: f"{c} samples per epoch cannot fill a batch of {need}" for name, c in small.items()})
        kept = [p for p in kept if p.name not in small]
    return kept, left_out


def warn_left_out(left_out: Mapping[str, str], tier: int, kept: int) -> None:
    """One warning for every stream left out, each named with its reason."""
    if left_out:
        named = "; ".join(f"{name} left out: {why}" for name, why in sorted(left_out.items()))
        warnings.warn(f"CorpusDataset: {len(left_out)} of {len(left_out) + kept} streams of tier {tier} left out "
                      f"(training reads the other {kept}): {named}", stacklevel=3)


class _DroppedBatches(logging.Filter):
    """Swallows streaming's per-stream "stream with index N" lines, keeping the indices."""

    def __init__(self) -> None:
        super().__init__()
        self.indices: list[int] = []

    def filter(self, record: logging.LogRecord) -> bool:
        match = _INDEX.search(record.getMessage())
        if match and record.levelno < logging.ERROR:
            self.indices.append(int(match.group(1)))
            return False
        return True


@contextmanager
def naming_dropped_batches(names: Sequence[str], batch_size: Any) -> Iterator[None]:
    """Around streaming's epoch plan: its "stream with index N" warnings become one naming the streams."""
    catcher = _DroppedBatches()
    loggers = [logging.getLogger(name) for name in BATCHING_LOGGERS]
    for logger in loggers:
        logger.addFilter(catcher)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(catcher)
    if catcher.indices:
        streams = [names[i] if 0 <= i < len(names) else f"stream {i}" for i in sorted(set(catcher.indices))]
        more = f" and {len(streams) - MAX_NAMED} more" if len(streams) > MAX_NAMED else ""
        warnings.warn(f"CorpusDataset: each epoch drops the incomplete last batch (batch_size {batch_size}) of "
                      f"{len(streams)} streams, so it yields fewer samples than len(): "
                      f"{', '.join(streams[:MAX_NAMED])}{more}", stacklevel=3)


def broadcast_from_rank0(value: Callable[[], Any]) -> Any:
    """`value()` computed on rank 0 and sent to every rank when torch.distributed runs (so all
    ranks of all nodes read the same manifest), else computed here."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, value())]
        except Exception as exc:  # every rank raises it, none waits for a value that never comes
            box = [(False, exc)]
    dist.broadcast_object_list(box, src=0)
    ok, result = box[0]
    if not ok:
        raise result
    return result


def align_ranks() -> None:
    """A barrier before StreamingDataset registers its shared memory, when torch.distributed runs.

    Each rank scans /dev/shm for the first free prefix on its own, before streaming's first
    barrier; ranks started seconds apart can see different prefixes when another job on the node
    registers or releases one in between, and the non-leader then fails ("shared memory prefix
    ... was not registered by local leader"; mosaicml/streaming#901 is the same family). Aligned,
    the scans happen together."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
