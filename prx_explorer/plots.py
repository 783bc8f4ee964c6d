"""Overview plots rendered server-side to PNG (matplotlib's Agg backend: no browser code).

Each plot is split by source, because cut-offs are chosen per source: a crawl and a stock
library have very different resolution and aspect-ratio distributions. They are drawn from the
`explorer_facets` rows (the `explorer` asset's counts per source: log-spaced size bins, buckets,
labels, reject reasons), never from the corpus's rows.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from prx_core.image.buckets import FLOOR_SIDE, MAX_UPSCALE, TIERS  # noqa: E402
from prx_core.stages.explorer.rows import ASPECT_BINS, SIDE_BINS  # noqa: E402
from prx_explorer.facets import by_source  # noqa: E402

MIN_ASPECT, MAX_ASPECT = 0.5, 2.0


def _png(fig: plt.Figure) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out.getvalue()


def _empty(fig: plt.Figure, ax: plt.Axes) -> bytes:
    ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return _png(fig)


def _log_histogram(rows: Sequence[dict], facet: str, per_octave: int, title: str, xlabel: str,
                   decorate: Callable[[plt.Axes], None]) -> bytes:
    """The facet's log-spaced bins (bin i covers [2^(i/n), 2^((i+1)/n)), `prx_core.stages.explorer.rows.size_bins`)
    stacked by source on a log axis, with the cut-offs `decorate` draws."""
    parts = sorted(by_source(rows, facet).items())
    fig, ax = plt.subplots(figsize=(9, 4.2))
    if not parts:
        return _empty(fig, ax)
    bins = sorted({int(b) for _, counts in parts for b in counts})
    edges = 2.0 ** (np.arange(bins[0], bins[-1] + 2) / per_octave)
    ax.hist([[2.0 ** ((int(b) + 0.5) / per_octave) for b in counts] for _, counts in parts], bins=edges,
            weights=[list(counts.values()) for _, counts in parts], stacked=True, label=[s for s, _ in parts])
    ax.set_xscale("log")
    decorate(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("images")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _png(fig)


def _tier_lines(ax: plt.Axes) -> None:
    ax.axvline(FLOOR_SIDE, color="crimson", lw=2, label=f"floor {FLOOR_SIDE}²")
    for tier in TIERS:
        ax.axvline(tier / MAX_UPSCALE, color="grey", ls="--", lw=1)
        ax.text(tier / MAX_UPSCALE, ax.get_ylim()[1] * 0.95, f" tier {tier}", color="grey", va="top", fontsize=8)


def _aspect_band(ax: plt.Axes) -> None:
    ax.axvspan(MIN_ASPECT, MAX_ASPECT, color="green", alpha=0.08, label="accepted [0.5, 2]")
    for bound in (MIN_ASPECT, MAX_ASPECT):
        ax.axvline(bound, color="green", lw=1.5)
    ax.set_xticks([0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4], labels=["1:4", "1:2", "3:4", "1:1", "3:2", "2:1", "3:1", "4:1"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def resolution(rows: Sequence[dict]) -> bytes:
    """Histogram of sqrt(W*H) per source, log scale, with the 384 floor and tier thresholds."""
    return _log_histogram(rows, "side", SIDE_BINS, "Resolution distribution (a tier T takes sqrt(W·H) ≥ 0.75·T)",
                          "sqrt(width × height), pixels (log)", _tier_lines)


def aspect_ratio(rows: Sequence[dict]) -> bytes:
    """Histogram of width/height per source on a log axis, with the accepted [0.5, 2] range."""
    return _log_histogram(rows, "aspect", ASPECT_BINS, "Aspect-ratio distribution", "aspect ratio width/height (log)",
                          _aspect_band)


def _stacked_bars(rows: Sequence[dict], facet: str, title: str, xlabel: str, top: int = 30,
                  order: Callable[[pd.Index], pd.Index] | None = None) -> bytes:
    table = pd.DataFrame(by_source(rows, facet)).fillna(0)  # value x source
    table = table[sorted(table.columns)]
    height = 3.2 + 0.22 * min(top, len(table))
    fig, ax = plt.subplots(figsize=(9, height))
    if table.empty:
        return _empty(fig, ax)
    table = table.loc[table.sum(axis=1).sort_values(ascending=False, kind="stable").index[:top]]
    if order is not None:
        table = table.loc[order(table.index)]
    left = np.zeros(len(table))
    for source in table.columns:
        ax.barh(table.index.astype(str), table[source].to_numpy(), left=left, label=str(source))
        left += table[source].to_numpy()
    for y, total in enumerate(left):
        ax.text(total, y, f" {int(total)}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _png(fig)


def _bucket_order(index: pd.Index) -> pd.Index:
    def key(name: str) -> tuple[float, float]:
        w, _, h = name.partition("x")
        return (math.sqrt(int(w) * int(h)), int(w) / int(h)) if w.isdigit() and h.isdigit() else (0.0, 0.0)
    return pd.Index(sorted(index, key=key))


def buckets(rows: Sequence[dict]) -> bytes:
    return _stacked_bars(rows, "bucket", "Images per bucket (by patch budget, then aspect)", "images",
                         order=_bucket_order)


def labels(rows: Sequence[dict]) -> bytes:
    return _stacked_bars(rows, "label", "Caption labels", "captioned images")


def reject_reasons(rows: Sequence[dict]) -> bytes:
    return _stacked_bars(rows, "rejected", "Reject reasons (ingest and bucketing)", "rejected images")


PLOTS: dict[str, tuple[str, Callable[[Sequence[dict]], bytes]]] = {
    "resolution": ("Resolution", resolution),
    "aspect": ("Aspect ratio", aspect_ratio),
    "buckets": ("Buckets", buckets),
    "labels": ("Labels", labels),
    "rejects": ("Reject reasons", reject_reasons),
}
