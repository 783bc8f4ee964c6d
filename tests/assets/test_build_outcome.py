"""`run_build`'s account of failures (issue 22, item 6), on stand-in assets with the real asset
names, partitions and dependencies (no Ray, no Lance: seconds): a failed step gives one line with
its cause, what depends on it is skipped (inside its run, and the later runs of that source), a
failed global `duplicates` skips every `skip_lists`, and the other sources go on."""

import dagster as dg

from prx_cli.build import failure_lines, run_build
from prx_assets.common import SOURCES
from prx_assets.settings import ALL_ASSETS, PER_SOURCE

DEPS = {"raw_source": [], "samples": ["raw_source"], "buckets": ["samples"], "phashes": ["samples"],
        "captions": ["samples"], "caption_labels": ["captions"], "caption_embeddings": ["captions"],
        "text_latents": ["captions", "samples"], "mds_shards": ["buckets", "captions", "text_latents"],
        "duplicates": ["phashes"],
        "skip_lists": ["mds_shards", "duplicates", "caption_labels"], "explorer": ["skip_lists", "phashes"]}


class Refused(RuntimeError):
    pass


def stand_ins(fail: dict[str, str]) -> list[dg.AssetsDefinition]:
    """One asset per real name; `fail` maps an asset to the partition it fails (or "global")."""
    def make(name: str) -> dg.AssetsDefinition:
        partitioned = name != "duplicates"

        @dg.asset(name=name, deps=DEPS[name], partitions_def=SOURCES if partitioned else None)
        def stand_in(context: dg.AssetExecutionContext) -> None:
            where = context.partition_key if partitioned else "global"
            if fail.get(name) == where:
                if name == "samples":
                    raise dg.Failure(description=f"source {where!r}: 6 of 6 rows refused\n(one line)")
                raise Refused(f"{name} broke\nsecond line")

        return stand_in

    return [make(name) for name in ALL_ASSETS]


def build(fail: dict[str, str]) -> tuple[object, list[str], list[str]]:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES.name, ["good", "bad"])
    log: list[str] = []
    outcome = run_build(dg.Definitions(assets=stand_ins(fail)), instance, ["good", "bad"], None, None,
                        echo=lambda *a, **k: log.append(" ".join(map(str, a))))
    return outcome, failure_lines(outcome), log


def test_a_failed_samples_skips_its_source_and_the_others_go_on() -> None:
    outcome, lines, log = build({"samples": "bad"})
    downstream = [a for a in PER_SOURCE if a not in ("raw_source", "samples")] + ["skip_lists", "explorer"]
    assert lines == ["samples [bad] FAILED: source 'bad': 6 of 6 rows refused (one line)",
                     f"{', '.join(downstream)} [bad] skipped: upstream samples failed"]
    assert "==> skip_lists, explorer [bad]: skipped (upstream samples failed)" in log
    assert "==> skip_lists, explorer [good]" in log
    assert outcome.runs == 4 and not outcome.ok and len(outcome.failed_runs) == 1
    assert ("mds_shards", "good") in outcome.metadata and ("skip_lists", "good") in outcome.metadata


def test_an_exception_is_named_by_type_and_first_message_a_failed_duplicates_skips_every_skip_list() -> None:
    outcome, lines, _ = build({"captions": "good", "duplicates": "global"})
    assert lines[0] == "captions [good] FAILED: Refused: captions broke second line"
    assert lines[1] == "duplicates [global] FAILED: Refused: duplicates broke second line"
    assert "caption_labels, caption_embeddings, text_latents, mds_shards, skip_lists, explorer [good] skipped: upstream " \
           "captions, duplicates failed" in lines
    assert "skip_lists, explorer [bad] skipped: upstream duplicates failed" in lines
    assert ("mds_shards", "bad") in outcome.metadata and ("mds_shards", "good") not in outcome.metadata
    assert ("buckets", "good") in outcome.metadata and outcome.runs == 3  # no skip_lists run started
