"""How many index segments a catch-up merges: a bounded, LSM-style policy (pure; no Lance here).

Every catch-up indexes the new fragments; left as a delta segment each, an index gains a segment
per catch-up (~95 per 100M-row source run) and a random-key lookup reads every one of them (a
5-key BTREE lookup read 0.95 MB from one segment, 17 MB from 20). Lance can only merge the newest
segments (`optimize_indices(num_indices_to_merge=n)` folds the newest n segments and the unindexed
rows into one), so the policy picks n:

- size ratio: fold the newest segments while the next older one holds fewer than `RATIO` (4)
  times the rows gathered so far. Sizes then fall by at least 4x from the oldest segment to the
  newest, ~log4(catch-ups) of them, and a row is rewritten only when its segment grows by a
  constant factor: simulated (`rewrites`) over 1,000 equal catch-ups (1B rows in 1M-row deltas),
  5 segments at most and each row rewritten ~9.5 times; over 16,000, 7 and ~13.5. A ratio that
  follows the table's size instead lets a tiny delta cascade through the whole index, and ratio 3
  reaches the bound at 16,000 catch-ups (then ~77 rewrites per row);
- hard bound: if that still leaves more than `max_segments`, fold as many more of the newest as it
  takes, whatever their sizes.

The bound on one catch-up's cost is rows rewritten: at most the rows of the segments it folds. No
policy that merges only the newest segments can both keep a fixed number of segments and bound one
catch-up below the whole index (at the bound, every catch-up must fold into the newest segment,
which then only grows), so the rare catch-up that folds the oldest segment rewrites up to the whole
index; it happens about once per 4-fold growth of the table.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_SEGMENTS = 8  # segments per bounded index: a random-key lookup reads at most this many
RATIO = 4.0  # a segment is folded into the newer rows only while it holds fewer than RATIO times them


def segments_to_merge(sizes: Sequence[int], new_rows: int, max_segments: int = MAX_SEGMENTS,
                      ratio: float = RATIO) -> int:
    """How many of the newest segments (`sizes`: rows per segment, oldest first) to fold together
    with `new_rows` unindexed rows; 0: the new rows become a delta segment of their own (or, with
    no new rows, nothing to do: a fold of fewer than two segments is never asked for)."""
    if max_segments < 1:
        raise ValueError(f"max_segments must be at least 1, got {max_segments}")
    count = len(sizes)
    if count == 0:
        return 0
    take = count if max_segments == 1 else _ratio_fold(sizes, new_rows, ratio)
    after = count - take + 1 if new_rows or take else count
    if after > max_segments:
        take = count + 1 - max_segments
    return take if new_rows or take >= 2 else 0


def _ratio_fold(sizes: Sequence[int], new_rows: int, ratio: float) -> int:
    """The size-ratio rule: fold the newest segments while the next older one is under `ratio`
    times what is gathered (`new_rows`, else the newest segment: folding it alone would be a no-op)."""
    count = len(sizes)
    take, gathered = (0, new_rows) if new_rows else (1, sizes[-1])
    while take < count and sizes[count - 1 - take] < ratio * gathered:
        gathered += sizes[count - 1 - take]
        take += 1
    return take


def fold(sizes: Sequence[int], new_rows: int, take: int) -> tuple[list[int], int]:
    """The segment sizes after folding the newest `take` segments with `new_rows` (what Lance's
    `optimize_indices(num_indices_to_merge=take)` does), and the rows that fold rewrites."""
    if take == 0:
        return ([*sizes, new_rows] if new_rows else list(sizes)), new_rows
    kept, folded = list(sizes[:len(sizes) - take]), sum(sizes[len(sizes) - take:]) + new_rows
    return [*kept, folded], folded


def rewrites(deltas: Sequence[int], max_segments: int = MAX_SEGMENTS,
             ratio: float = RATIO) -> tuple[list[int], int, int, int]:
    """A history of catch-ups of `deltas` new rows each under the policy: the final sizes, the most
    segments seen, the rows rewritten in all and by the costliest catch-up."""
    sizes: list[int] = []
    most = total = worst = 0
    for new_rows in deltas:
        sizes, cost = fold(sizes, new_rows, segments_to_merge(sizes, new_rows, max_segments, ratio))
        most, total, worst = max(most, len(sizes)), total + cost, max(worst, cost)
    return sizes, most, total, worst
