"""A search as it appears in the URL, and the Lance filter over the `explorer` table it stands for.

Request values only ever become SQL literals quoted by `sql_literal` (a tier: checked digits):
never column names, never SQL. The filters are the table's own columns (BITMAP-indexed, so a
count or a page is an indexed scan), except a metadata filter on a key other than `label`, which
is a scan of `samples` bounded twice: at most `META_IDS` sample ids found, at most `META_SCAN_ROWS`
rows read (fragment by fragment), each limit said on the page when it cut the answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any
from urllib.parse import urlencode

from prx_core.stages.explorer.rows import META_KEY
from prx_core.store import lance_io
from prx_explorer.metadata import has_metadata, split_filter
from prx_explorer.params import choice_param, int_param, meta_param, text_param
from prx_explorer.view import View, both, in_list

MAX_PAGE = 200  # a browse page reads every matching row before it (Lance offsets): past page 200, narrow the search
MAX_TIER = 1 << 16
BY = ("caption", "clip")
FILTERS = ("source", "label", "tier", "bucket", "group", "skipped", "rejected", "caption")
COLUMN = {"source": "source", "label": "label", "tier": "tier", "bucket": "bucket", "group": "group_id",
          "skipped": "skip_reason", "rejected": "reject_reason", "caption": "caption_problem"}
WORST = ("shortest", "longest", "repetitive", "retried")  # the "worst captions" views (explorer.rows.WORST)
META_IDS = 5000  # sample ids a metadata filter on another key than `label` may select (an IN list)
META_SCAN_ROWS = 2_000_000  # rows of `samples` such a filter reads at most (its map column has no index)
NO_METADATA = "this corpus's samples carry no metadata"


@dataclass(frozen=True)
class Query:
    """A search as it appears in the URL. `skipped` / `rejected`: "" any, "no", "yes" or a reason."""

    q: str = ""
    like: str = ""  # a sample_id: "more like this"
    by: str = "caption"  # caption | clip
    source: str = ""
    label: str = ""
    tier: str = ""
    bucket: str = ""
    group: str = ""
    skipped: str = ""
    rejected: str = ""
    meta: str = ""  # key:value of the samples' source metadata, e.g. label:cat
    caption: str = ""  # a caption problem (prx_core.models.caption_checks), e.g. repetition
    worst: str = ""  # one of WORST: the source's worst captions by that measure, worst first
    page: int = 1

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> Query:
        """The query of a request; a malformed value raises `BadRequest` (a 400)."""
        checked = ("by", "tier", "page", "meta", "worst")
        values = {f.name: text_param(params, f.name) for f in fields(cls) if f.name not in checked}
        tier = int_param(params, "tier", None, 1, MAX_TIER)
        return cls(**values, by=choice_param(params, "by", BY, "caption"), tier="" if tier is None else str(tier),
                   meta=meta_param(params, "meta"), worst=choice_param(params, "worst", WORST, ""),
                   page=int_param(params, "page", 1, 1, MAX_PAGE) or 1)

    def url(self, **changes: object) -> str:
        """This query with `changes`, as a `?...` string (page resets unless given)."""
        values = asdict(replace(self, **{"page": 1, **changes}))
        kept = {k: v for k, v in values.items() if v not in ("", None) and not (k == "page" and v == 1)
                and not (k == "by" and v == "caption")}
        return "?" + urlencode(kept) if kept else "?"

    @property
    def only_source(self) -> bool:
        """Whether no filter but `source` narrows the rows: the facets table then has the menus' counts."""
        return not (self.q or self.like or self.meta or self.worst
                    or any(getattr(self, n) for n in FILTERS if n != "source"))


def _condition(name: str, value: str) -> str:
    """The filter of one menu's value."""
    column = COLUMN[name]
    if name in ("skipped", "rejected") and value in ("no", "yes"):
        return f"{column} IS {'NOT ' if value == 'yes' else ''}NULL"
    if name == "skipped":  # a row's skip reasons are a sorted, comma-joined set: the reason is one of them
        return f"array_has(string_to_array({column}, ','), {lance_io.sql_literal(value)})"
    if name == "tier":  # checked digits (params.int_param)
        return f"{column} = {int(value)}"
    return f"{column} = {lance_io.sql_literal(value)}"  # one reject reason per row: the first refusal


def meta_filter(view: View, query: Query) -> tuple[str, str | None]:
    """The filter of `meta=key:value` and a note when it cannot be exact. The `label` key is the
    explorer's own `meta_label` column; another key looks the sample ids up in `samples` (its
    metadata map), at most META_IDS of them, narrowed to the query's source."""
    samples = view.table("samples")
    if not has_metadata(samples):
        return "false", NO_METADATA
    key, wanted = split_filter(query.meta)
    if key == META_KEY:
        return f"meta_label = {lance_io.sql_literal(wanted)}", None
    where = f"array_has(map_extract(metadata, {lance_io.sql_literal(key)}), {lance_io.sql_literal(wanted)})"
    if query.source:
        where = both(f"source = {lance_io.sql_literal(query.source)}", where)
    ids, read = bounded_ids(samples, where)
    note = None
    if len(ids) > META_IDS:
        note = f"the metadata filter matched more than {META_IDS:,} samples: only the first {META_IDS:,} are shown"
    elif read < samples.count_rows():
        note = (f"the metadata filter searched the first {read:,} samples only (it has no index): "
                "narrow it with a source, or use the label key")
    return in_list("sample_id", ids[:META_IDS]), note


def bounded_ids(samples: Any, where: str) -> tuple[list[str], int]:
    """The sample ids matching `where` (at most META_IDS + 1) and the rows read to find them: whole
    fragments in table order until META_SCAN_ROWS rows are read or enough ids are found."""
    ids: list[str] = []
    read = 0
    for fragment in samples.get_fragments():
        if read >= META_SCAN_ROWS or len(ids) > META_IDS:
            break
        found = fragment.to_table(columns=["sample_id"], filter=where, limit=META_IDS + 1 - len(ids))
        ids += found["sample_id"].to_pylist()
        read += fragment.count_rows()
    return ids, read


def lance_filter(view: View, query: Query) -> tuple[str | None, list[str]]:
    """The Lance filter over `explorer` of every menu and the metadata filter (None: every row),
    with the notes a page shows about it."""
    parts = [_condition(name, value) for name in FILTERS if (value := getattr(query, name))]
    notes: list[str] = []
    if query.meta:
        where, note = meta_filter(view, query)
        parts.append(where)
        notes += [note] if note else []
    return both(*parts), notes
