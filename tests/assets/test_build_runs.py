"""`run_build` under Ctrl-C, its console, and `duplicates` with nothing upstream (issue 27, item 1),
on the stand-in assets of test_build_outcome (no Ray, no Lance: seconds): a SIGINT stops the build
after the run it lands in (the step is "interrupted", not failed; no further run starts), also when
the step swallows it; the runs' console shows progress and one-line errors, tracebacks only with
`verbose`; `duplicates` is skipped, not run into "materialize `phashes` first", when no source's
`phashes` was written."""


import os
import signal
import time

import dagster as dg
from test_build_outcome import DEPS, stand_ins

from prx_cli.build import failure_lines, run_build
from prx_assets.common import SOURCES
from prx_assets.settings import PER_SOURCE


def interrupting(name: str, where: str, swallow: bool = False) -> list[dg.AssetsDefinition]:
    """The stand-ins, with `name` of partition `where` sending SIGINT to this process mid-step (and,
    with `swallow`, catching what Dagster raises for it, as a stage's broad `except` might)."""
    assets = [a for a in stand_ins({}) if a.key.to_user_string() != name]

    @dg.asset(name=name, deps=DEPS[name], partitions_def=SOURCES)
    def interrupted(context: dg.AssetExecutionContext) -> None:
        context.log.info(f"{name}[{context.partition_key}]: 1/4 units")
        if context.partition_key != where:
            return
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)  # Dagster raises its interruption here, at once
        except BaseException:
            if not swallow:
                raise

    return [*assets, interrupted]


def build(assets: list[dg.AssetsDefinition], verbose: bool = False) -> tuple[object, list[str]]:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES.name, ["good", "bad"])
    log: list[str] = []
    outcome = run_build(dg.Definitions(assets=assets), instance, ["good", "bad"], None, None,
                        echo=lambda *a, **k: log.append(" ".join(map(str, a))), verbose=verbose)
    return outcome, log


def test_a_sigint_in_a_step_stops_the_build_after_that_run() -> None:
    started = time.monotonic()
    outcome, log = build(interrupting("samples", "good"))
    assert time.monotonic() - started < 8, "the step slept on: the SIGINT did not interrupt it"
    assert outcome.interrupted and not outcome.ok and outcome.runs == 1, log
    assert outcome.interrupted_steps == ["samples [good]"] and not outcome.failures and not outcome.failed_runs
    assert log[1].startswith("    interrupted in "), log
    chain = ", ".join(a for a in PER_SOURCE if a not in ("raw_source", "samples"))
    assert outcome.not_started == [f"{chain} [good]", f"{', '.join(PER_SOURCE)} [bad]", "duplicates [global]",
                                   "skip_lists, explorer [good]", "skip_lists, explorer [bad]"], outcome.not_started
    lines = failure_lines(outcome)
    assert lines[0] == "samples [good] interrupted" and lines[1] == f"{chain} [good] not started: interrupted", lines
    assert not any("FAILED" in line or "skipped" in line for line in lines), lines


def test_a_sigint_the_step_swallows_still_stops_the_build() -> None:
    """Dagster forgets a SIGINT it did not raise (or one a stage caught): the build's own watch sees it."""
    outcome, log = build(interrupting("caption_labels", "good", swallow=True))
    assert outcome.interrupted and outcome.runs == 1, log
    assert log[1].startswith("    ok in "), log  # the run itself completed
    assert outcome.not_started[0] == f"{', '.join(PER_SOURCE)} [bad]", outcome.not_started
    assert ("mds_shards", "good") in outcome.metadata and ("raw_source", "bad") not in outcome.metadata


def test_the_console_shows_progress_and_one_line_errors_tracebacks_only_when_verbose(capfd) -> None:
    def failing() -> list[dg.AssetsDefinition]:
        assets = [a for a in stand_ins({"buckets": "bad"}) if a.key.to_user_string() != "samples"]

        @dg.asset(name="samples", deps=DEPS["samples"], partitions_def=SOURCES)
        def samples(context: dg.AssetExecutionContext) -> None:
            context.log.info(f"samples[{context.partition_key}]: 1/1 units, 3 rows")
            context.log.error("a worker said:\nsecond line of its error")

        return [*assets, samples]

    quiet, _ = build(failing())
    quiet_err = capfd.readouterr().err
    assert "samples[good]: 1/1 units, 3 rows" in quiet_err and "samples[bad]: 1/1 units, 3 rows" in quiet_err
    assert "a worker said: (more: --verbose)" in quiet_err and "second line" not in quiet_err, quiet_err
    for noise in ("Traceback", "Stack Trace", "STEP_FAILURE", "RUN_FAILURE", "Not executing", "buckets broke"):
        assert noise not in quiet_err, (noise, quiet_err)
    assert failure_lines(quiet)[0] == "buckets [bad] FAILED: Refused: buckets broke second line"

    verbose, _ = build(failing(), verbose=True)
    verbose_err = capfd.readouterr().err
    assert "STEP_FAILURE" in verbose_err and "Stack Trace" in verbose_err and "second line of its error" in verbose_err
    assert failure_lines(verbose) == failure_lines(quiet)


def test_when_every_source_fails_before_phashes_duplicates_is_skipped_not_run_into_its_own_error() -> None:
    """`duplicates` with no `phashes` written would fail "materialize `phashes` first": misleading.
    (The stand-in `duplicates` fails whenever it runs.)"""
    assets = stand_ins({"samples": "bad", "duplicates": "global"})
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES.name, ["good", "bad"])
    for sources, ran in ((None, True), (["bad"], False)):  # one source got through / none did
        log: list[str] = []
        outcome = run_build(dg.Definitions(assets=assets), instance, ["good", "bad"], sources, None,
                            echo=lambda *a, **k: log.append(" ".join(map(str, a))))
        lines = failure_lines(outcome)
        assert ("duplicates [global] FAILED: Refused: duplicates broke second line" in lines) == ran, lines
        assert ("==> duplicates [global]: skipped (upstream samples failed)" in log) == (not ran), log
        assert ("duplicates [global] skipped: upstream samples failed" in lines) == (not ran), lines


def test_the_runs_are_named_jobs_not_the_ephemeral_one() -> None:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES.name, ["good"])
    outcome = run_build(dg.Definitions(assets=stand_ins({})), instance, ["good"], None, None, echo=lambda *a, **k: None)
    assert outcome.ok and outcome.runs == 3
    assert sorted(r.job_name for r in instance.get_runs()) == ["build_source", "dedup_corpus", "publish_source"]
