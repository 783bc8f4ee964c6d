"""benchmarks/model_actors.py's arithmetic: medians per kind, the kept / baseline ratios, the summary
comparison, and no CPU figure where no cgroup can be made. Its builds are real `prx-corpus build`s
(~60-100 CPU-s each on the demo), measured by hand: docs/benchmarks.md has the command and figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import model_actors

SUMMARY = ["source  samples", "demo  10", "total  10"]


def fake_builds(cpu: dict[str, list[float | None]], other_summary: bool = False):
    seen: dict[str, int] = {}

    def run_build(catalog: Path, work: Path, kind: str) -> dict:
        n = seen[kind] = seen.get(kind, -1) + 1
        summary = SUMMARY[:-1] + ["total  11"] if other_summary and kind == "kept" else SUMMARY
        return {"kind": kind, "seconds": 10.0 * (n + 1) if kind == "baseline" else 6.0 * (n + 1),
                "cpu_seconds": cpu[kind][n], "summary": summary}
    return run_build


def test_medians_ratios_and_the_summary_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu = {"baseline": [100.0, 80.0, 90.0], "kept": [60.0, 54.0, 57.0]}
    monkeypatch.setattr(model_actors, "run_build", fake_builds(cpu))
    results = model_actors.run(tmp_path / "sources.yaml", tmp_path, repeats=3)
    assert [b["kind"] for b in results["builds"]] == ["baseline", "kept"] * 3  # alternated, not one kind then the other
    assert results["medians"] == {"baseline": {"seconds": 20.0, "cpu_seconds": 90.0},
                                  "kept": {"seconds": 12.0, "cpu_seconds": 57.0}}
    assert results["kept_over_baseline"] == {"seconds": 0.6, "cpu_seconds": 0.63} and results["same_summary"]
    assert "kept / baseline (medians): wall 0.6x, CPU 0.63x; same summary: True" in model_actors.format_table(results)
    no_cpu = {"baseline": [None], "kept": [None]}
    monkeypatch.setattr(model_actors, "run_build", fake_builds(no_cpu, other_summary=True))
    results = model_actors.run(tmp_path / "sources.yaml", tmp_path, repeats=1)
    assert results["kept_over_baseline"]["cpu_seconds"] is None and not results["same_summary"]
    assert "| kept | 6.0 | - |" in model_actors.format_table(results)


def test_no_cpu_group_where_none_can_be_made(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setattr(model_actors, "ACCT", tmp_path / "not-a-folder")
    assert model_actors.cpu_group("prx-bench-test") is None
