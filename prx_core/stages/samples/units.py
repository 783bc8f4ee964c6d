"""How `samples` cuts a source into units: by bytes, then by rows or files where bytes mislead.

Source files are grouped into units of about `unit_bytes` (a file is never split): right for tar
shards and image tables, whose bytes are their images. Two kinds of source read far more per byte:

- a URL table (`url_column`; parquet files, a Lance dataset, or a Hugging Face dataset's parquet
  files): a few GB list ~100M URLs, and a
  worker fetches ~30 images/s, so a byte unit of one such table would run for days and pass its
  time limit whole. A byte unit holding more than `unit_rows` rows is cut again: whole files while
  they fit, a bigger file into row ranges ending at its row groups where they can
  (`prx_core.sources.row_ranges`, from the footers; nothing is decoded).
- an image folder: a byte unit of many small files is that many reads, one after another. A unit
  holding more than `unit_files` image files is cut again: whole folders while they fit, a bigger
  folder into ranges of its sorted file names (every `unit_files`-th name, noted by the walk
  where the folder is listed: the driver never holds a folder's listing).

Ids are `u000000`... in plan order, so the same listing and sizes always give the same units (a
rerun or a resume finds the units it recorded). A source the second cut leaves as it was keeps
its plan and its manifest: `unit_rows` and `unit_files` enter the manifest only where they cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prx_core.compute.units import Unit
from prx_core.sources.catalog import TABLE_FORMATS, SourceSpec
from prx_core.sources.folders.walk import fragments_of
from prx_core.sources.readers import folder_entries, fragment_sizes
from prx_core.sources.row_ranges import cut_rows, files_row_groups

UNIT_BYTES = 64 << 30  # ~1M images of 64 KB: one unit, one Lance fragment, ~an hour of one core
UNIT_ROWS = 100_000  # URLs per unit: ~1 h at ~30 images/s, a quarter of the 4 h limit (units.samples_seconds)
UNIT_FILES = 100_000  # image files per unit: ~1 h of reads one after another at ~30 files/s (S3)

Part = tuple[Any, Any]  # rows [start, stop) of a table file, or file names [lo, hi) of a folder


@dataclass
class Plan:
    """A source's units, its listing (what the fingerprint digests) and the sizes that cut it."""

    units: list[Unit]
    sizes: list[tuple[str, int]]
    pinned: dict[str, int] = field(default_factory=dict)


def group_fragments(sizes: list[tuple[str, int]], unit_bytes: int) -> list[Unit]:
    """Consecutive source fragments grouped into units of about `unit_bytes` (a bigger fragment is
    a unit of its own): the same listing always gives the same units."""
    units: list[Unit] = []
    group: list[str] = []
    size = 0
    for fragment, nbytes in sizes:
        if group and size + nbytes > unit_bytes:
            units.append(Unit(f"u{len(units):06d}", 0, {"fragments": group}))
            group, size = [], 0
        group.append(fragment)
        size += nbytes
    if group:
        units.append(Unit(f"u{len(units):06d}", 0, {"fragments": group}))
    return units


def is_url_table(spec: SourceSpec) -> bool:
    """A table whose rows are URLs to fetch, in files this module can read in row ranges."""
    return bool(spec.url_column) and spec.format in TABLE_FORMATS


def plan_units(spec: SourceSpec, storage_options: dict[str, Any] | None, unit_bytes: int, unit_rows: int,
               unit_files: int) -> Plan:
    """The source's units: byte units, cut again by rows (a URL table) or files (an image folder)."""
    if spec.format == "imagefolder":
        entries = folder_entries(spec, storage_options, cut_every=unit_files)
        sizes = fragments_of(entries)
        by_folder = {e.folder: e for e in entries}
        counts = {f: by_folder[f].image_files for f, _ in sizes}
        parts = {f: name_parts(by_folder[f].cuts, by_folder[f].image_files, unit_files) for f, _ in sizes
                 if by_folder[f].cuts}
        return recut(group_fragments(sizes, unit_bytes), sizes, counts, parts, unit_files, "unit_files")
    sizes = fragment_sizes(spec, storage_options)
    if not is_url_table(spec):
        return Plan(group_fragments(sizes, unit_bytes), sizes)
    groups = table_row_groups(spec, [f for f, _ in sizes], storage_options)
    counts = {f: sum(g or []) for f, g in groups.items()}
    parts = {f: [((a, b), b - a) for a, b in cut_rows(g, unit_rows)] for f, g in groups.items()
             if g and sum(g) > unit_rows}
    return recut(group_fragments(sizes, unit_bytes), sizes, counts, parts, unit_rows, "unit_rows")


def table_row_groups(spec: SourceSpec, fragments: list[str],
                     storage_options: dict[str, Any] | None) -> dict[str, list[int] | None]:
    """Rows per row group of each parquet file (None: an unreadable footer), or per Lance fragment
    (one group: a fragment is read in any row range)."""
    if spec.format == "lance":
        import lance

        from prx_core.sources.tables import lance_options

        dataset = lance.dataset(spec.uri, storage_options=lance_options(spec.uri, storage_options))
        return {f: [dataset.get_fragment(int(f)).count_rows()] for f in fragments}
    # a Hugging Face dataset's Arrow files (`save_to_disk`) count their rows only when read: planned whole
    parquet = [f for f in fragments if spec.format != "huggingface" or f.lower().endswith(".parquet")]
    groups = dict(zip(parquet, files_row_groups(parquet, storage_options)))
    return {f: groups.get(f) for f in fragments}


def name_parts(cuts: tuple[str, ...], files: int, every: int) -> list[tuple[Part, int]]:
    """A folder's name ranges at its cuts, with the image files each holds."""
    bounds: list[str | None] = [None, *cuts, None]
    return [((bounds[k], bounds[k + 1]), min(every, files - k * every)) for k in range(len(cuts) + 1)]


def recut(units: list[Unit], sizes: list[tuple[str, int]], counts: dict[str, int],
          parts: dict[str, list[tuple[Part, int]]], limit: int, setting: str) -> Plan:
    """Each byte unit holding more than `limit` rows (or files) cut again: whole fragments while
    they fit, one unit per part of a bigger fragment (`parts`). Untouched, the plan is the byte
    plan (with rows counted); cut, it is numbered again and `setting` enters the manifest."""
    out: list[Unit] = []
    cut = False
    for unit in units:
        fragments = list(unit.spec["fragments"])
        total = sum(counts.get(f, 0) for f in fragments)
        if total <= limit or len(fragments) == 1 and fragments[0] not in parts:
            out.append(Unit(unit.id, total, unit.spec))
            continue
        cut = True
        out += split(fragments, counts, parts, limit)
    if not cut:
        return Plan(out, sizes)
    return Plan([Unit(f"u{n:06d}", u.rows, u.spec) for n, u in enumerate(out)], sizes, {setting: limit})


def split(fragments: list[str], counts: dict[str, int], parts: dict[str, list[tuple[Part, int]]],
          limit: int) -> list[Unit]:
    """Fragments regrouped by their counts up to `limit`; a fragment with parts is one unit per part."""
    out: list[Unit] = []
    group: list[str] = []
    held = 0

    def close() -> None:
        nonlocal group, held
        if group:
            out.append(Unit("", held, {"fragments": group}))
        group, held = [], 0

    for fragment in fragments:
        if fragment in parts:
            close()
            out += [Unit("", n, {"fragments": [fragment], "part": list(part)}) for part, n in parts[fragment]]
            continue
        if group and held + counts.get(fragment, 0) > limit:
            close()
        group.append(fragment)
        held += counts.get(fragment, 0)
    close()
    return out
