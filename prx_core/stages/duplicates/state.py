"""What the global `duplicates` stage remembers between runs, so a run after one source's new
`phashes` recomputes only the groups that source touches.

The state file `<root>/_state/duplicates.json` (written atomically after each commit):

    {"format": 1, "code_version": "2", "phashes_version": 41, "duplicates_version": 17, "duplicates_rows": 5120,
     "fragments": {"12": {"files": "3f2a9c01d4e5", "deletions": "40:7734:12", "sources": {"web": 998}}, ...}}

`fragments` is the layout of the `phashes` version the table was computed from: per fragment id,
a digest of its data files, its deletion file, and its live rows per source. A source's
fingerprint is its rows per (fragment id, files): fragments are immutable but for deletions,
which only grow, so an equal fingerprint means the same rows. The layout of a new version is
carried over for every fragment whose files and deletions are unchanged; only new or changed
fragments are read (their `source` column, on workers). Which sources exist falls out of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lance import LanceDataset, LanceOperation

from prx_core.compute.groupby import count_values
from prx_core.store.lance_io import StorageOptions, fragment_identity
from prx_core.store.storage import Storage, put_atomic

STATE = ("_state", "duplicates.json")
FORMAT = 1
# commits that leave the rows of a table as they were: index work, compaction (a Rewrite, after
# a ReserveFragments that pylance 14 shows as a bare BaseOperation), config
PRESERVING = (LanceOperation.CreateIndex, LanceOperation.Rewrite, LanceOperation.UpdateConfig,
              LanceOperation.BaseOperation)


@dataclass(frozen=True)
class Layout:
    """Live rows per source of every fragment of one `phashes` version."""

    fragments: Mapping[int, Mapping[str, Any]]  # id -> {"files", "deletions", "sources": {source: rows}}

    def sources(self) -> set[str]:
        return {s for f in self.fragments.values() for s in f["sources"]}

    def fingerprints(self) -> dict[str, dict[str, int]]:
        """source -> rows per "<fragment id>:<files digest>"."""
        out: dict[str, dict[str, int]] = {}
        for frag_id, frag in self.fragments.items():
            for source, rows in frag["sources"].items():
                out.setdefault(source, {})[f"{frag_id}:{frag['files']}"] = rows
        return out

    def rows(self, sources: Iterable[str] | None = None) -> int:
        wanted = None if sources is None else set(sources)
        return sum(n for f in self.fragments.values() for s, n in f["sources"].items() if wanted is None or s in wanted)

    def matched(self, sources: Iterable[str]) -> dict[int, int]:
        """Rows of `sources` per fragment id (fragments holding none left out): units to read."""
        wanted = set(sources)
        counts = {i: sum(n for s, n in f["sources"].items() if s in wanted) for i, f in self.fragments.items()}
        return {i: n for i, n in counts.items() if n}

    def to_json(self) -> dict[str, Any]:
        return {str(i): dict(f) for i, f in sorted(self.fragments.items())}


def changed_sources(before: Layout, after: Layout) -> list[str]:
    """Sources whose rows differ between two layouts: added, removed or rewritten."""
    old, new = before.fingerprints(), after.fingerprints()
    return sorted(s for s in set(old) | set(new) if old.get(s) != new.get(s))


def read_layout(ds: LanceDataset, uri: str, storage_options: StorageOptions = None,
                previous: Layout | None = None) -> tuple[Layout, int]:
    """The layout of the pinned `ds`, and the fragments whose sources had to be counted (on Ray
    workers): those `previous` does not know with the same files and deletions."""
    known = previous.fragments if previous is not None else {}
    fragments: dict[int, dict[str, Any]] = {}
    unknown: list[int] = []
    for fragment in ds.get_fragments():
        files, deletions = fragment_identity(fragment)
        old = known.get(fragment.fragment_id)
        if old is not None and old["files"] == files and old["deletions"] == deletions:
            fragments[fragment.fragment_id] = dict(old)
        else:
            fragments[fragment.fragment_id] = {"files": files, "deletions": deletions, "sources": {}}
            unknown.append(fragment.fragment_id)
    for frag_id, counts in count_values(uri, ds.version, unknown, "source", storage_options).items():
        fragments[frag_id]["sources"] = dict(sorted(counts.items()))
    return Layout(fragments), len(unknown)


def untouched_since(ds: LanceDataset | None, version: int | None, rows: int | None) -> bool:
    """Whether the table still holds the `rows` rows of `version`: the same version, or only
    commits that keep rows (index refreshes, compaction) since, and as many rows (a cheap guard
    against an operation pylance cannot name). Unknown history (cleaned-up versions) counts as
    touched."""
    if ds is None or version is None or ds.version < version:
        return False
    if ds.version == version:
        return True
    if rows is None or ds.count_rows() != rows:
        return False
    return all(_operation(ds, v) in PRESERVING for v in range(version + 1, ds.version + 1))


def _operation(ds: LanceDataset, version: int) -> type | None:
    """The operation class of the commit that made `version`; None when it cannot be read."""
    try:
        transaction = ds.read_transaction(version)
    except TypeError as exc:  # pylance 14 builds RewrittenIndex with 2 of its 5 arguments: a
        # compaction of an indexed table (the only operation holding one) cannot be decoded
        return LanceOperation.Rewrite if "RewrittenIndex" in str(exc) else None
    except (OSError, ValueError, RuntimeError):
        return None
    return None if transaction is None or transaction.operation is None else type(transaction.operation)


@dataclass(frozen=True)
class State:
    phashes_version: int
    duplicates_version: int
    duplicates_rows: int
    layout: Layout
    code_version: str


def load_state(storage: Storage, code_version: str) -> State | None:
    """The state of the last committed run; None when missing, unreadable or of another code
    version (any of which makes the next run a full recompute)."""
    fs = storage.filesystem()
    path = storage.uri(*STATE)
    try:
        fs.invalidate_cache()
        if not fs.exists(path):
            return None
        data = json.loads(fs.cat_file(path))
        if data.get("format") != FORMAT or data.get("code_version") != code_version:
            return None
        layout = Layout({int(i): f for i, f in data["fragments"].items()})
        return State(int(data["phashes_version"]), int(data["duplicates_version"]), int(data["duplicates_rows"]),
                     layout, code_version)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_state(storage: Storage, state: State) -> None:
    payload = {"format": FORMAT, "code_version": state.code_version, "phashes_version": state.phashes_version,
               "duplicates_version": state.duplicates_version, "duplicates_rows": state.duplicates_rows,
               "fragments": state.layout.to_json()}
    put_atomic(storage.filesystem(), storage.uri(*STATE), json.dumps(payload, sort_keys=True).encode())

