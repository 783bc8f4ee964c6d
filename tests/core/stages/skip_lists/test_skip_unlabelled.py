"""A sample whose label failed (below `caption_labels_coverage`'s threshold, so nothing blocked)
never reaches training unnoticed: while the policy skips labels, `skip_lists` skips it with the
reason `unlabelled` (the training loader honours it like every skip reason)."""

from __future__ import annotations

import pytest
from test_mds_stage import CAPTIONER
from test_skip_lists_stage import LABELER, storage  # noqa: F401  (the fixture: published streams, labels, duplicates)

from prx_core.shards.skiplists.files import read_skip_lists
from prx_core.stages.skip_lists.stage import SkipPolicy, build_skip_lists
from prx_core.store import lance_io
from prx_core.store.storage import Storage

pytestmark = pytest.mark.usefixtures("ray_cluster")


def drop_label(store: Storage) -> tuple[str, str]:
    """Delete the label of one published, visual (not skipped) content: (its sample_id, content_id)."""
    index = lance_io.read_table(store.lance_uri("mds_index")).sort_by("sample_id").to_pylist()
    labels = {r["content_id"]: r["label"] for r in lance_io.read_table(store.lance_uri("caption_labels")).to_pylist()}
    row = next(r for r in index if labels[r["content_id"]] == "visual")
    lance_io.require_table(store.lance_uri("caption_labels")).delete(f"content_id = '{row['content_id']}'")
    return row["sample_id"], row["content_id"]


def skipped_by_reason(store: Storage) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for skip in read_skip_lists(store.root, "photos"):
        out.setdefault(skip.reason, set()).update(skip.sample_ids)
    return out


def test_an_unlabelled_sample_is_skipped_while_labels_are(storage: Storage) -> None:  # noqa: F811
    sample, _ = drop_label(storage)
    report = build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy())
    lists = skipped_by_reason(storage)
    assert lists["unlabelled"] == {sample}
    assert sum(s.by_reason.get("unlabelled", 0) for s in report.streams) == 1
    assert sample not in lists["text"] | lists["nsfw"]

    build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy(unlabelled=False))
    assert "unlabelled" not in skipped_by_reason(storage)
    build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy(labels=()))  # labels not filtered: no reason to
    assert "unlabelled" not in skipped_by_reason(storage)


def test_fully_labelled_streams_skip_nothing_as_unlabelled(storage: Storage) -> None:  # noqa: F811
    build_skip_lists("photos", storage, CAPTIONER, LABELER, SkipPolicy())
    assert "unlabelled" not in skipped_by_reason(storage)
    assert SkipPolicy().version() != SkipPolicy(unlabelled=False).version()
