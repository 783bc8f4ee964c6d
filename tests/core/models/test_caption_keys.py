"""Caption keys: a model caption keyed by its content, a source caption by (content, text), and
every key of a content sorted beside it, so that a content unit's keys stay together in the
shared tables' indexes under the `source` captioner too."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from prx_core.models.caption_base import CaptionerConfig
from prx_core.models.caption_keys import caption_keys, keyed_by_text, source_caption_key


def content(i: int) -> str:
    return hashlib.sha256(f"image {i}".encode()).hexdigest()  # as ingest makes them: SHA-256 hex of the bytes


def test_a_model_captioner_keys_by_content_and_the_source_captioner_by_content_and_text() -> None:
    contents, texts = [content(0), content(0), content(1)], ["a dog", "a cat", "a dog"]
    model, source = CaptionerConfig("openai", model="m", endpoint="http://127.0.0.1:1").version(), CaptionerConfig("source").version()
    assert not keyed_by_text(model) and keyed_by_text(source)
    assert caption_keys(model, contents, texts) == contents
    keys = caption_keys(source, contents, texts)
    assert len(set(keys)) == 3 and not set(keys) & set(contents)  # never a content id, one per (content, text)
    assert keys == caption_keys(source, contents, list(texts))  # the same pair, the same key
    assert source_caption_key(content(0), None) == source_caption_key(content(0), "") != keys[0]
    with pytest.raises(ValueError, match="2 content ids but 1 original captions"):
        caption_keys(source, contents[:2], texts[:1])


@pytest.mark.parametrize("texts_per_content", [1, 3])
def test_keys_sort_by_their_content(texts_per_content: int) -> None:
    """The keys of a range of content ids are exactly the keys between that range's bounds:
    what lets a content unit's lookups read only the index pages of its range."""
    rng = random.Random(texts_per_content)
    contents = [content(i) for i in range(300)]
    pairs = [(c, f"caption {rng.random()}") for c in contents for _ in range(texts_per_content)]
    keyed = sorted((source_caption_key(c, t), c) for c, t in pairs)
    assert [c for _, c in keyed] == sorted(c for c, _ in pairs)  # sorted keys, sorted contents
    lo, hi = sorted(contents)[100], sorted(contents)[200]
    inside = {k for k, c in keyed if lo <= c < hi}
    assert inside == {k for k, _ in keyed if lo <= k < hi} and len(inside) == 100 * texts_per_content


def test_the_source_captioners_version_names_the_rule() -> None:
    """Keys made under the earlier rule (the hash alone) are never read as this rule's: its version differs."""
    inputs = CaptionerConfig("source").version_inputs()
    assert inputs["rule"] == "per-sample-by-content"
    earlier = hashlib.sha256(json.dumps({**inputs, "rule": "per-sample"}, sort_keys=True).encode())
    assert CaptionerConfig("source").version() != "source-" + earlier.hexdigest()[:16]
