"""The build's live progress display (issue 43): the stages' own progress lines (Throttle, the
same text a Ray job sends through Pipes) parsed, drawn as one status line with a bar in a
terminal, other lines printed above it, a stage's last report kept as a plain line."""

from __future__ import annotations

import io
import logging
import shutil

import pytest

from prx_cli.build_console import LiveHandler
from prx_cli.build_progress import STATUS, LiveStatus, StageProgress, parse_progress, render
from prx_core.compute.parallel import Throttle


def throttle_lines(**kwargs) -> list[str]:
    lines: list[str] = []
    throttle = Throttle(lines.append, "samples[photos] chunk", seconds=0.0, unit="units")
    throttle(3, 10, **kwargs)
    throttle(10, 10, **kwargs)
    return lines


@pytest.mark.parametrize("kwargs", [{}, {"rows": 300}, {"rows": 300, "total_rows": 1000}])
def test_every_throttle_line_parses(kwargs: dict) -> None:
    partial, final = (parse_progress(line) for line in throttle_lines(**kwargs))
    assert partial == StageProgress("samples[photos] chunk", 3, 10, "units", partial.rest)
    assert "/s" in partial.rest and "ETA" in partial.rest and not partial.finished
    assert final.finished and "ETA" not in final.rest
    assert parse_progress("captions[photos]: 3 of 12 eligible contents have no source caption") is None
    assert parse_progress("==> samples [photos]") is None


def test_the_bar_fits_the_terminal() -> None:
    progress = StageProgress("mds_shards[photos]", 6, 24, "chunks", "1,200 rows/s, ETA 1m30s")
    assert render(progress, 120) == ("mds_shards[photos] [######..................] 6/24 chunks · 1,200 rows/s, "
                                     "ETA 1m30s")
    assert len(render(progress, 40)) < 40 and render(progress, 40).endswith("...")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_status_line_under_the_other_lines() -> None:
    out = Terminal()
    status = LiveStatus(out)
    status.update(StageProgress("samples[a]", 1, 4, "units", "2.0/s, ETA 2s"))
    status.update(StageProgress("samples[a]", 2, 4, "units", "2.0/s, ETA 1s"))
    assert out.getvalue().count("\r\x1b[2K") == 2 and out.getvalue().endswith("2/4 units · 2.0/s, ETA 1s")
    status.update(StageProgress("samples[a]", 4, 4, "units", "2.0/s"))
    assert out.getvalue().endswith("\r\x1b[2Ksamples[a]: 4/4 units, 2.0/s\n") and not status.shown


def test_the_console_handler_routes_progress_to_the_status_line(monkeypatch: pytest.MonkeyPatch) -> None:
    out, inner_out = Terminal(), io.StringIO()
    monkeypatch.setattr(STATUS, "stream", out)
    inner = logging.StreamHandler(inner_out)
    handler = LiveHandler(inner)
    logger = logging.Logger("t")
    logger.addHandler(handler)
    logger.info("samples[a]: 1/3 units, 0.5/s, ETA 4s")
    logger.info("==> an ordinary line")
    assert inner_out.getvalue() == "==> an ordinary line\n"  # only the ordinary line reached Dagster's handler
    assert "[########................] 1/3 units" in out.getvalue()
    width = shutil.get_terminal_size((100, 20)).columns
    drawn = render(StageProgress("samples[a]", 1, 3, "units", "0.5/s, ETA 4s"), width)
    assert out.getvalue().endswith("\r\x1b[2K" + drawn)  # cleared for the ordinary line, then drawn again
    monkeypatch.setattr(STATUS, "current", None)


def test_warnings_say_what_each_source_has_then_why_and_the_fix_once() -> None:
    from prx_cli.build_report import warning_lines
    from prx_assets.mds_shards import small_streams_text

    warnings = [f"mds_shards_stream_sizes[{s}]: {small_streams_text(['512/448x576'], n, 256, 'warn')}"
                for s, n in (("a", 3), ("b", 5))] + ["samples_fragment_health[a]"]
    lines = warning_lines(warnings)
    assert lines[:2] == ["WARN check mds_shards_stream_sizes[a]: 1 of 3 streams hold fewer than 256 samples, one "
                         "global batch (512/448x576)",
                         "WARN check mds_shards_stream_sizes[b]: 1 of 5 streams hold fewer than 256 samples, one "
                         "global batch (512/448x576)"]
    assert lines[2].strip().startswith("The trainer's per_stream batching raises") and "Fix: training.small_streams" in lines[2]
    assert lines[3:] == ["WARN check samples_fragment_health[a]"]
