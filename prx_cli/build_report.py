"""The report `prx-corpus build` saves under the root: what a 10-minute (or 10-hour) build did, to
read afterwards, not only in the scrollback.

`<root>/_reports/builds/<UTC time>-<pid>.md`, Markdown: the outcome and its problems (each failure,
failed check and warning with its why and fix), the corpus summary table, rejects by source, stage
and reason with the likely fix (`prx_core.stages.samples.refusals`' table), the duplicate and caption
quality rates, the runs' and assets' timings (from the instance's run records, tagged with the
report: `prx/build_report`), and explorer links (`explorer.base_url`, else the command that serves
one). Its path is chosen before the first run and set as every run's tag, so each materialization
links to the report of the build that made it (`prx/build_report`, `prx_assets.common.catalog_source`)
and the CLI names it at the end.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

from prx_core.stages.samples.refusals import fix_for
from prx_core.store import lance_io
from prx_core.store.storage import Storage

REPORT_TAG = "prx/build_report"
REPORT_ENV = "PRX_BUILD_REPORT"  # set by `prx-corpus build` for its runs' tags (prx_cli.build.run_tags)
FOLDER = ("_reports", "builds")
TOP_REASONS = 12
# rejects of the stages after ingest: what they mean for a source, beside the ingest's fixes
# (prx_core.stages.samples.refusals)
HINTS = {
    "below_floor": "smaller than the smallest bucket (384x384 at tier 512): thumbnails and icons; expected unless most are",
    "aspect_ratio": "outside the buckets' aspect range (1:2 to 2:1): banners, panoramas; expected unless most are",
    "no_caption": "no source caption: give the source a caption column or files, or configure a VLM captioner",
    "caption_rejected": "the caption checks refused its caption twice: the explorer's caption filter shows them",
    "small_stream": "its stream is smaller than one global batch (training.small_streams: drop)",
}


def warning_lines(warnings: list[str]) -> list[str]:
    """`WARN check <check>[<source>]: <what>` per warning, then once per check why it matters and what
    to do (the rest of its description: the same for every source)."""
    groups: dict[str, list[tuple[str, str, str]]] = {}
    for warning in warnings:
        label, _, text = warning.partition(": ")
        check, _, partition = label.partition("[")
        what, _, advice = text.partition(". ")
        groups.setdefault(check, []).append((partition.rstrip("]"), what, advice))
    lines = []
    for check, items in groups.items():
        lines += [f"WARN check {check}[{partition}]" + (f": {what}" if what else "") for partition, what, _ in items]
        lines += [f"     {advice}" for advice in dict.fromkeys(a for _, _, a in items if a)]
    return lines


def new_report_uri(storage: Storage) -> str:
    """Where this build's report goes: named by its start (UTC) and the process, never reused."""
    return storage.uri(*FOLDER, time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{os.getpid()}.md")


def report_tags() -> dict[str, str]:
    """The tag naming this build's report, on every run it launches (none outside a build)."""
    uri = os.environ.get(REPORT_ENV)
    return {REPORT_TAG: uri} if uri else {}


def write_report(storage: Storage, uri: str, text: str) -> None:
    fs = storage.filesystem()
    fs.makedirs(uri.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(uri, "w") as out:
        out.write(text)


def run_timings(instance: Any, uri: str) -> list[dict[str, Any]]:
    """The build's runs as the instance recorded them (tagged with the report), oldest first."""
    import dagster as dg

    records = instance.get_run_records(dg.RunsFilter(tags={REPORT_TAG: uri}))
    out = []
    for record in sorted(records, key=lambda r: r.create_timestamp.timestamp()):
        run = record.dagster_run
        seconds = (record.end_time - record.start_time) if record.start_time and record.end_time else None
        out.append({"run": run.run_id[:8], "job": run.job_name, "partition": run.tags.get("dagster/partition", "global"),
                    "status": run.status.value, "seconds": seconds})
    return out


def reject_counts(storage: Storage, sources: Iterable[str]) -> Counter[tuple[str, str, str]]:
    """(source, stage, reason) -> rejects, of the given sources."""
    uri = storage.lance_uri("rejects")
    names = list(sources)
    if not names or not lance_io.table_exists(uri, storage.lance_storage_options()):
        return Counter()
    where = "source IN (" + ", ".join(lance_io.sql_literal(n) for n in names) + ")"
    rows = lance_io.read_table(uri, ["source", "stage", "reason"], where, storage.lance_storage_options())
    counted = rows.group_by(["source", "stage", "reason"]).aggregate([([], "count_all")]).to_pylist()
    return Counter({(r["source"], r["stage"], r["reason"]): r["count_all"] for r in counted})


def render_report(*, ok: bool, started: float, finished: float, root: str, catalog: str, formats: Mapping[str, str],
                  problems: list[str], summary: list[dict[str, Any]], rejects: Counter[tuple[str, str, str]],
                  metadata: Mapping[tuple[str, str | None], Mapping[str, Any]], runs: list[dict[str, Any]],
                  explorer_url: str | None) -> str:
    """The report's Markdown (pure: every input already read)."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    lines = [f"# PRX corpus build, {when}: {'ok' if ok else 'FAILED'}", "",
             f"- corpus root: `{root}`", f"- catalog: `{catalog}` ({', '.join(formats) or 'no source'})",
             f"- {len(runs)} runs in {human(finished - started)}", ""]
    lines += ["## Problems", ""] + ([f"- {p.strip()}" for p in problems] or ["none"]) + [""]
    lines += ["## Corpus", ""] + table(summary) + [""]
    lines += rejects_section(rejects, summary, formats)
    lines += dedup_section(summary, metadata.get(("duplicates", None)))
    lines += captions_section(metadata)
    lines += timings_section(runs, metadata)
    lines += explorer_section(explorer_url, root, list(formats))
    return "\n".join(lines) + "\n"


def rejects_section(rejects: Counter[tuple[str, str, str]], summary: list[dict[str, Any]],
                    formats: Mapping[str, str]) -> list[str]:
    rows_of = {r["source"]: r["samples"] + r["rejects"] for r in summary}
    rows = [{"source": s, "stage": stage, "reason": reason, "rows": n,
             "share": f"{n / rows_of[s]:.1%}" if rows_of.get(s) else "-",
             "likely fix": HINTS.get(reason) or fix_for(reason, formats.get(s, ""))}
            for (s, stage, reason), n in sorted(rejects.items(), key=lambda kv: (kv[0][0], -kv[1]))]
    shown = rows[:TOP_REASONS * max(1, len(formats))]
    more = [f"({len(rows) - len(shown)} smaller reasons not shown)"] if len(rows) > len(shown) else []
    return ["## Rejects by reason", ""] + (table(shown) if shown else ["none"]) + more + [""]


def dedup_section(summary: list[dict[str, Any]], run: Mapping[str, Any] | None) -> list[str]:
    rows = [{"source": r["source"], "samples": r["samples"], "duplicates (not kept)": r["duplicates"],
             "duplicate rate": f"{r['duplicates'] / r['samples']:.2%}" if r["samples"] else "-"} for r in summary]
    head = []
    if run:
        head = [f"This build's `duplicates` run: {run.get('groups', 0)} groups, {run.get('duplicates', 0)} duplicates "
                f"({float(run.get('duplicate_rate', 0.0)):.2%}), {run.get('mode', '?')} run.", ""]
    return ["## Duplicates", ""] + head + table(rows) + [""]


def captions_section(metadata: Mapping[tuple[str, str | None], Mapping[str, Any]]) -> list[str]:
    rows = []
    for (asset, source), meta in sorted(metadata.items(), key=lambda kv: str(kv[0])):
        if asset != "captions":
            continue
        made = int(meta.get("captioned", 0))
        rows.append({"source": source, "captioner": meta.get("captioner", "?"), "eligible": meta.get("eligible", 0),
                     "captioned": made, "reused": meta.get("reused", 0), "failed": meta.get("failed", 0),
                     "retried": meta.get("retried", 0), "rejected": meta.get("rejected", 0),
                     "rejected rate": f"{int(meta.get('rejected', 0)) / made:.2%}" if made else "-",
                     "captioned share": f"{float(meta.get('captioned_share', 0.0)):.1%}"})
    return ["## Captions", ""] + (table(rows) if rows else ["no `captions` run in this build"]) + [""]


def timings_section(runs: list[dict[str, Any]], metadata: Mapping[tuple[str, str | None], Mapping[str, Any]]) -> list[str]:
    shown = [{**r, "seconds": f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"} for r in runs]
    assets = [{"asset": asset, "partition": partition or "global", "duration": meta["duration"]}
              for (asset, partition), meta in sorted(metadata.items(), key=lambda kv: str(kv[0])) if meta.get("duration")]
    return (["## Timings", "", "Runs:", ""] + (table(shown) if shown else ["none"])
            + ["", "Assets (the stage's own time):", ""] + (table(assets) if assets else ["none"]) + [""])


def explorer_section(base_url: str | None, root: str, sources: list[str]) -> list[str]:
    if not base_url:
        return ["## Explorer", "", f"Serve it with `prx-corpus browse --root {root}` (or set `explorer.base_url` for "
                "links here).", ""]
    links = [f"- [{s}]({base_url}/?{urlencode({'source': s})}): its samples; "
             f"[rejected]({base_url}/?{urlencode({'source': s, 'rejected': 'yes'})}), "
             f"[skip-listed]({base_url}/?{urlencode({'source': s, 'skipped': 'yes'})})" for s in sources]
    return ["## Explorer", "", f"- [overview]({base_url}/overview)"] + links + [""]


def table(rows: list[Mapping[str, Any]]) -> list[str]:
    if not rows:
        return ["none"]
    columns = list(rows[0])
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return out + ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def human(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs} s"


def save_build_report(uri: str, storage: Storage, instance: Any, outcome: Any, summary: list[dict[str, Any]],
                      started: float, catalog: Any, sources: list[str], explorer_url: str | None) -> str:
    """Gathers what the build did (its outcome, the corpus as its tables now read, the instance's
    run records) and writes the report to `uri`; returns it."""
    from prx_cli.build import failure_lines

    problems = (failure_lines(outcome) + [f"FAIL blocking check {label}" for label in outcome.failed_blocking]
                + [f"FAIL {label}" for label in outcome.failed_runs] + warning_lines(outcome.warnings))
    formats = {name: catalog.get(name).format for name in sources}
    text = render_report(ok=outcome.ok, started=started, finished=time.time(), root=storage.root, catalog=catalog.path,
                         formats=formats, problems=problems, summary=summary,
                         rejects=reject_counts(storage, sources), metadata=outcome.metadata,
                         runs=run_timings(instance, uri), explorer_url=explorer_url)
    write_report(storage, uri, text)
    return text
