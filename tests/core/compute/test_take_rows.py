"""`take_rows`: rows by address from a pinned version, in the order asked, with one open of each
(table, version) per process however many takes a unit makes."""

from __future__ import annotations

from pathlib import Path

import lance
import pyarrow as pa
import pytest

from prx_core.compute import parallel
from prx_core.compute.parallel import take_rows


@pytest.fixture
def table(tmp_path: Path) -> tuple[str, int, list[int]]:
    """A table of 100 rows (n = 0..99) in two fragments, those with n % 10 == 3 deleted: its version
    and the live rows' addresses, in n order."""
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"n": list(range(100))}), uri, max_rows_per_file=50)
    ds = lance.dataset(uri)
    ds.delete("n % 10 = 3")
    ds = lance.dataset(uri)
    addresses = ds.to_table(columns=["n"], with_row_address=True)["_rowaddr"].to_pylist()
    return uri, ds.version, addresses


def test_rows_come_in_the_order_asked_from_the_pinned_version(table) -> None:
    uri, version, addresses = table
    picked = [addresses[i] for i in (45, 3, 80, 0)]
    first = take_rows(uri, version, picked, ["n"])["n"].to_pylist()
    lance.write_dataset(pa.table({"n": [1000]}), uri, mode="overwrite")  # the table moves on
    live = [n for n in range(100) if n % 10 != 3]
    assert take_rows(uri, version, picked, ["n"])["n"].to_pylist() == first == [live[i] for i in (45, 3, 80, 0)]


def test_one_open_per_table_and_version(table, monkeypatch: pytest.MonkeyPatch) -> None:
    uri, version, addresses = table
    opened: list[int] = []
    real = lance.dataset
    monkeypatch.setattr(lance, "dataset", lambda *a, **k: opened.append(k.get("version")) or real(*a, **k))
    parallel._pinned_dataset.cache_clear()
    for start in range(0, 64, 32):  # a unit's takes, 32 rows at a time
        take_rows(uri, version, addresses[start:start + 32], ["n"])
    assert opened == [version]
    take_rows(uri, version - 1, addresses[:4], ["n"])  # another pinned version is another open
    assert opened == [version, version - 1]


def test_a_missing_row_is_an_error(table) -> None:
    uri, version, addresses = table
    with pytest.raises(Exception):
        take_rows(uri, version, [addresses[0], (7 << 32) | 5], ["n"])
