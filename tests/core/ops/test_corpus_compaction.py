"""prx_core.ops.compaction: the one entry point the compact_corpus Dagster op and `prx-corpus compact` call.
The per-table rules are tests/core/upkeep/test_lance_compaction.py's; here, that the corpus-wide call finds the
tables that exist, compacts them per partition, reports each as it goes, and prunes after them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from prx_core.ops.compaction import TableMaintenance, maintain_corpus
from prx_core.store import lance_io
from prx_core.store.schemas import BUCKETS, SAMPLES
from prx_core.store.storage import Storage

CLI = str(Path(sys.executable).with_name("prx-corpus"))


def small_table(storage: Storage, table: str, schema: pa.Schema, sources: str = "ab", rows: int = 30) -> str:
    """`rows` rows per source, committed per source in fragments of 10 (as a unit-wise stage leaves them)."""
    uri = storage.lance_uri(table)
    for source in sources:
        data = pa.Table.from_pylist([{"sample_id": f"{source}/{i}", "source": source, "content_id": f"{source}{i}",
                                      "width": 64, "height": 48} for i in range(rows)], schema=schema)
        fragments = lance_io.write_fragments(uri, data, schema, max_rows_per_file=10)
        lance_io.replace_rows(uri, f"source = {lance_io.sql_literal(source)}", fragments, schema)
    return uri


@pytest.mark.usefixtures("ray_cluster")  # each table is maintained on a Ray worker
def test_every_existing_table_is_compacted_per_source_and_reported_as_it_goes(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    uri = small_table(storage, "buckets", BUCKETS)
    heard: list[TableMaintenance] = []
    done = maintain_corpus(storage, on_table=heard.append)
    assert [t.table for t in done.tables] == [t.table for t in heard] == ["buckets"]  # the others do not exist
    report = done.tables[0].compaction
    assert (report.fragments_before, report.fragments_after) == (6, 2)
    assert sorted({tuple(set(f.to_table(columns=["source"])["source"].to_pylist()))
                   for f in lance.dataset(uri).get_fragments()}) == [("a",), ("b",)]  # never a mixed fragment
    assert lance_io.read_table(uri).num_rows == 60
    assert done.pruned_lines() == ["mds: 0 streams, 0 superseded chunks removed, 0 kept within the retention",
                                   "manifests: 0 superseded tier manifests removed"]


def test_the_command_compacts_a_corpus_with_its_own_ray(tmp_path: Path) -> None:
    """As an operator runs it: its own process and embedded Ray, one line per table, then the pruning."""
    storage = Storage(str(tmp_path / "corpus"))
    small_table(storage, "samples", SAMPLES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    done = subprocess.run([CLI, "compact", "--root", storage.root], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("samples: CompactionReport(fragments_before=6, fragments_after=2"), lines
    assert lines[-2:] == ["mds: 0 streams, 0 superseded chunks removed, 0 kept within the retention",
                          "manifests: 0 superseded tier manifests removed"]
    missing = subprocess.run([CLI, "compact", "--root", str(tmp_path / "none")], capture_output=True, text=True,
                             timeout=120, env=env)
    assert missing.returncode == 2 and "no corpus at" in missing.stderr
