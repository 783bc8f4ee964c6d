"""Which kept sample the training loader reads in place of a skipped one.

The r-th skipped index of a shard goes to kept rank (A*(r + epoch*s) + B) mod m of that shard (m
kept, s skipped): a bijection, so substitutes spread evenly over the shard and rotate with the
epoch instead of over-sampling the same images every epoch; staying in the shard means the
substitute is already local when streaming prefetched the skipped sample. A shard with nothing
kept falls back to the whole stream. `B` comes from the stream's name only, so the choice does not
depend on where the corpus lives (local or s3://), nor on ranks or workers.

Nothing here is per rank beyond the shard offsets: every lookup is a binary search of the
stream's sorted skip positions, which the manifest maps once per node (read through a
memoryview: Python ints, no numpy scalar per probe). A kept sample costs one search (~1 us on a
1M-sample stream); a skipped one three more (its shard's skipped range, then kept rank -> index
by bisecting `skipped[i] - i`), for the 5% or so of samples that are skipped.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

import numpy as np

MULTIPLIER = 2654435761  # a prime larger than any shard or stream: x -> A*x + B mod m is a bijection


class Substitutes:
    """Maps a skipped stream-local index to a kept one of the same stream (see the module)."""

    def __init__(self, name: str, count: int, skipped: np.ndarray, shard_sizes: Sequence[int]) -> None:
        self.skipped = skipped  # sorted unique, usually a view of the mapped manifest
        self.view = memoryview(np.ascontiguousarray(skipped, np.int64))  # the same pages, read as ints
        self.shard_starts = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)
        self.kept = int(count) - len(skipped)
        self.offset = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "view"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.view = memoryview(np.ascontiguousarray(self.skipped, np.int64))

    def __call__(self, j: int, epoch: int) -> int:
        j = int(j)  # streaming passes numpy ints: 1 << 63 would overflow
        k = bisect.bisect_left(self.view, j)
        if k == len(self.view) or self.view[k] != j:
            return j
        return self.hit(j, k, epoch)

    def hit(self, j: int, k: int, epoch: int) -> int:
        """Substitute of `j`, the `k`-th skipped index."""
        skipped, n = self.view, len(self.view)
        shard = int(np.searchsorted(self.shard_starts, j, "right")) - 1
        a, b = int(self.shard_starts[shard]), int(self.shard_starts[shard + 1])
        lo, hi = bisect.bisect_left(skipped, a, 0, k), bisect.bisect_left(skipped, b, k)
        if (b - a) > (hi - lo):  # the shard keeps some: its r-th skipped of s among its m kept
            m, r, s, base, first, last = (b - a) - (hi - lo), k - lo, hi - lo, a - lo, lo, hi
        else:
            m, r, s, base, first, last = self.kept, k, n, 0, 0, n
        rank = base + (MULTIPLIER % m * ((r + epoch % m * (s % m)) % m) + self.offset % m) % m
        # kept rank -> index: rank + #{i: skipped[i] - i <= rank}; within the shard every i < lo
        # counts and no i >= hi does, so only the shard's own skipped are searched
        return rank + bisect.bisect_right(range(n), rank, first, last, key=lambda i: skipped[i] - i)
