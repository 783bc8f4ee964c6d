"""Overview plots rendered server-side to PNG (matplotlib's Agg backend: no browser code).

Each plot is split by source, because cut-offs are chosen per source: a crawl and a stock
library have very different resolution and aspect-ratio distributions.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from prx_core.image.buckets import FLOOR_SIDE, MAX_UPSCALE, TIERS  # noqa: E402

MIN_ASPECT, MAX_ASPECT = 0.5, 2.0


def _png(fig: plt.Figure) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out.getvalue()


def _sized(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["width"].fillna(0) > 0) & (frame["height"].fillna(0) > 0)]


def _by_source(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    return [(str(source), part) for source, part in frame.groupby("source", sort=True)]


def _empty(fig: plt.Figure, ax: plt.Axes) -> bytes:
    ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return _png(fig)


def _side(frame: pd.DataFrame) -> pd.Series:
    return np.sqrt(frame["width"].astype(float) * frame["height"].astype(float))


def _aspect(frame: pd.DataFrame) -> pd.Series:
    return frame["width"].astype(float) / frame["height"].astype(float)


def _log_histogram(frame: pd.DataFrame, measure: Callable[[pd.DataFrame], pd.Series],
                   span: Callable[[pd.Series], tuple[float, float]], bins: int, title: str, xlabel: str,
                   decorate: Callable[[plt.Axes], None]) -> bytes:
    """A histogram of `measure` stacked by source on a log axis, with the cut-offs `decorate` draws."""
    frame = _sized(frame)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    if frame.empty:
        return _empty(fig, ax)
    parts = _by_source(frame)
    ax.hist([measure(p) for _, p in parts], bins=np.geomspace(*span(measure(frame)), bins), stacked=True,
            label=[s for s, _ in parts])
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


def resolution(frame: pd.DataFrame) -> bytes:
    """Histogram of sqrt(W*H) per source, log scale, with the 384 floor and tier thresholds."""
    return _log_histogram(frame, _side, lambda v: (max(16.0, v.min() * 0.9), v.max() * 1.1), 40,
                          "Resolution distribution (a tier T takes sqrt(W·H) ≥ 0.75·T)",
                          "sqrt(width × height), pixels (log)", _tier_lines)


def aspect_ratio(frame: pd.DataFrame) -> bytes:
    """Histogram of width/height per source on a log axis, with the accepted [0.5, 2] range."""
    return _log_histogram(frame, _aspect, lambda v: (min(0.25, v.min() * 0.9), max(4.0, v.max() * 1.1)), 41,
                          "Aspect-ratio distribution", "aspect ratio width/height (log)", _aspect_band)


def _stacked_bars(frame: pd.DataFrame, column: str, title: str, xlabel: str, top: int = 30,
                  order: Callable[[pd.Index], pd.Index] | None = None) -> bytes:
    counts = frame.dropna(subset=[column]).astype({column: "string"})
    if column == "reject_reason":
        counts = counts.assign(reject_reason=counts[column].str.split(",")).explode(column)
    table = pd.crosstab(counts[column], counts["source"]) if not counts.empty else pd.DataFrame()
    height = 3.2 + 0.22 * min(top, len(table))
    fig, ax = plt.subplots(figsize=(9, height))
    if table.empty:
        return _empty(fig, ax)
    table = table.loc[table.sum(axis=1).sort_values(ascending=False).index[:top]]
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


def buckets(frame: pd.DataFrame) -> bytes:
    return _stacked_bars(frame, "bucket", "Images per bucket (by patch budget, then aspect)", "images",
                         order=_bucket_order)


def labels(frame: pd.DataFrame) -> bytes:
    return _stacked_bars(frame, "label", "Caption labels", "captioned images")


def reject_reasons(frame: pd.DataFrame) -> bytes:
    return _stacked_bars(frame, "reject_reason", "Reject reasons (ingest and bucketing)", "rejected images")


PLOTS: dict[str, tuple[str, Callable[[pd.DataFrame], bytes]]] = {
    "resolution": ("Resolution", resolution),
    "aspect": ("Aspect ratio", aspect_ratio),
    "buckets": ("Buckets", buckets),
    "labels": ("Labels", labels),
    "rejects": ("Reject reasons", reject_reasons),
}
