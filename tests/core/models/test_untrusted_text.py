"""Captions are untrusted text (issue 15, item 8): source captions are cleaned and capped at
ingest and counted in the `samples` report (real parquet source, real Lance, a real local Ray);
every captioner backend stores cleaned, capped captions; and the parsers of model answers never
raise, whatever a server sends (property-tested with hypothesis). Transport limits (body cap,
keys over plain http): test_untrusted_responses.py."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jpegs import jpeg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prx_core.models.caption_base import CaptionerConfig, CaptionResult
from prx_core.models.caption_text import DEFAULT_MAX_CAPTION_CHARS, clean_caption
from prx_core.models.captioning import SourceCaptioner
from prx_core.models.captioning_openai import parse_response
from prx_core.models.captioning_vllm import Postprocess
from prx_core.models.label_base import LABELS, LabelResult
from prx_core.models.labels_llm import label_from_reply, result_from_answer
from prx_core.models.openai_http import BadResponse, Reply, parse_chat
from prx_core.sources.catalog import SourceSpec
from prx_core.sources.ingest import ingest_batch
from prx_core.sources.readers import RECORD_SCHEMA
from prx_core.stages.samples.stage import build_samples
from prx_core.store.storage import Storage

CONTROLS = "".join(map(chr, [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x7F, 0xA0)]))
TEXT = "A red\x00 car\x1b[31m on a \x07road\r\nat night\x85with\tlights\u2028on\x7f\x9b"  # what Arrow can hold
HOSTILE = TEXT + "\ud800"  # and a lone surrogate, which a Python str can hold
LONG = "word " * 3000  # 15,000 characters
PHOTO = jpeg(np.full((64, 64, 3), 120, dtype=np.uint8))


# ----------------------------------------------------------------------------- the cleaning rule


def test_control_characters_and_surrogates_are_removed_and_line_breaks_normalised() -> None:
    result = clean_caption(HOSTILE)
    assert result.text == "A red car[31m on a road\nat night\nwith lights\non" and result.cleaned and not result.truncated
    assert not set(result.text) & set(CONTROLS) and result.text.encode("utf-8")  # encodable: no lone surrogate
    assert clean_caption("  two  spaces\t\tand\n\n\n\nlines  ") == clean_caption("two spaces and\n\nlines")
    assert clean_caption("  plain  text \n").cleaned is False  # whitespace alone is not "cleaned"


def test_unicode_text_is_kept_as_is() -> None:
    for text in ("\u732b\u304c\u5ea7\u3063\u3066\u3044\u308b", "\u0642\u0637\u0629 \u200f\u0633\u0648\u062f\u0627\u0621",
                 "family \U0001F468\u200d\U0001F469\u200d\U0001F467 and \u2764\ufe0f", "cafe\u0301 na\u00efve \u00a0x",
                 "\u0915\u094d\u0937 \u0e01\u0e34\u0e19"):
        assert clean_caption(text).text == text and not clean_caption(text).cleaned


def test_empty_after_cleaning_is_no_caption() -> None:
    for text in (None, "", "   \n\t ", "\x00\x01\x1b", "\ud800\udfff"):
        assert clean_caption(text).text is None
    assert clean_caption(b"bytes \xff caption").text == "bytes \ufffd caption"  # a foreign binary column


def test_long_captions_are_cut_at_a_word_boundary_or_hard_without_spaces() -> None:
    cut = clean_caption(LONG)
    assert cut.truncated and cut.text == ("word " * 400).strip() and len(cut.text) <= DEFAULT_MAX_CAPTION_CHARS
    cjk = clean_caption("\u732b" * 5000, 100)
    assert cut.truncated and cjk.text == "\u732b" * 100
    combining = clean_caption("e\u0301" * 100, 51)  # never an accent without its letter, or a letter without it
    assert combining.text == "e\u0301" * 25
    emoji = clean_caption("x" * 99 + "\U0001F468\u200d\U0001F469", 101)
    assert emoji.text == "x" * 99  # a joined emoji is dropped whole, not cut into another one
    assert clean_caption("y" * 100, 100) == clean_caption("y" * 100)  # exactly the cap: untouched
    with pytest.raises(ValueError, match="max_caption_chars"):
        CaptionerConfig("source", max_caption_chars=3)  # a cap that would empty captions is a config error


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.none(), st.text(st.characters(codec=None), max_size=400),
                      st.lists(st.sampled_from(["a", " ", "\n", "\r", "\t", "\x00", "\x85", "\u0301", "\u200d",
                                                "\ud800", "\u732b", "\U0001F468", "b\u0301"]), max_size=300).map("".join)),
       cap=st.integers(16, 120))
def test_cleaning_never_raises_and_is_bounded_clean_and_idempotent(text: str | None, cap: int) -> None:
    result = clean_caption(text, cap)
    if result.text is None:
        return
    assert 0 < len(result.text) <= cap and result.text == result.text.strip()
    assert not set(result.text) & set(CONTROLS + "\r\u2028\u2029") and "\t" not in result.text
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in result.text)
    assert clean_caption(result.text, cap) == type(result)(result.text)  # clean output is a fixed point


# ----------------------------------------------------------------------------- ingest and the samples stage


def records(*captions: str | None) -> pa.Table:
    rows = [{"source_key": f"k{i}", "image": PHOTO, "caption": c, "embedding": None} for i, c in enumerate(captions)]
    return pa.Table.from_pylist(rows, schema=RECORD_SCHEMA)


def test_ingest_cleans_caps_and_counts_source_captions() -> None:
    counts: Counter[str] = Counter()
    samples, rejects = ingest_batch("src", records(TEXT, LONG, "fine", None, "\x00 \x1b"), counts=counts)
    stored = samples["original_caption"].to_pylist()
    assert rejects.num_rows == 0 and stored[0] == clean_caption(TEXT).text and stored[2] == "fine"
    assert len(stored[1]) <= DEFAULT_MAX_CAPTION_CHARS and stored[3] is None and stored[4] is None
    assert counts == Counter(captions_cleaned=2, captions_truncated=1)
    short, _ = ingest_batch("src", records(LONG), max_caption_chars=100)
    assert short["original_caption"].to_pylist() == [("word " * 20).strip()]


@pytest.mark.usefixtures("ray_cluster")
def test_samples_stage_stores_clean_captions_and_reports_the_counts(tmp_path: Path) -> None:
    folder = tmp_path / "hostile"
    folder.mkdir()
    pq.write_table(pa.table({"key": ["a", "b", "c"], "image": [PHOTO] * 3, "caption": [TEXT, LONG, "ok"]}),
                   folder / "part-0.parquet")
    spec = SourceSpec("hostile", "parquet", str(folder), image_column="image", caption_column="caption", key_column="key")
    storage = Storage(str(tmp_path / "corpus"))
    report = build_samples(spec, storage, max_caption_chars=500)
    assert (report.rows, report.captions_cleaned, report.captions_truncated) == (3, 1, 1)
    table = lance.dataset(storage.lance_uri("samples")).to_table(columns=["source_key", "original_caption"])
    stored = {row["source_key"]: row["original_caption"] for row in table.to_pylist()}
    assert stored == {"a": clean_caption(TEXT).text, "b": ("word " * 100).strip(), "c": "ok"}


# ----------------------------------------------------------------------------- generated captions


def test_every_captioner_backend_stores_cleaned_capped_captions() -> None:
    source = SourceCaptioner(CaptionerConfig("source", max_caption_chars=100))
    assert source.caption_batch([b"", b"", b""], [HOSTILE, LONG, "\x00"]) == [
        CaptionResult(clean_caption(HOSTILE).text), CaptionResult(("word " * 20).strip()),
        CaptionResult.failed("no_source_caption", "the source has no caption for this image")]
    body = json.dumps({"choices": [{"message": {"content": HOSTILE.replace("\ud800", "") + LONG}}]})
    result, _ = parse_response(body, 100)
    assert result.caption is not None and len(result.caption) <= 100 and "\x00" not in result.caption
    config = CaptionerConfig("vllm", model="m", max_caption_chars=100)
    row = Postprocess(config)({"content_id": "c", "generated_text": HOSTILE + LONG, "num_generated_tokens": 9})
    assert row["caption"] == " ".join(clean_caption(HOSTILE + LONG, 100).text.split()) and row["error"] == ""
    blank = Postprocess(config)({"content_id": "c", "generated_text": "\x00\x1b ", "num_generated_tokens": 1})
    assert blank["caption"] == "" and blank["error"].startswith("empty_caption")


def test_the_cap_enters_versions_only_where_it_changes_stored_captions() -> None:
    vllm = CaptionerConfig("vllm", model="m")
    assert CaptionerConfig("vllm", model="m", max_caption_chars=DEFAULT_MAX_CAPTION_CHARS).version() == vllm.version()
    assert CaptionerConfig("vllm", model="m", max_caption_chars=500).version() != vllm.version()
    assert CaptionerConfig("source", max_caption_chars=500).version() != CaptionerConfig("source").version()


# ----------------------------------------------------------------------------- parsers never raise


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


ODD_BODIES = [
    nested(100_000), '{"choices": ' + nested(50_000) + "}", '{"choices":[{"message":{"content":[{"text":5}]}}]}',
    '{"choices":[{"message":{"content":[{"text":null}, 3, "x"]}}]}', '{"choices":[{"message":{"content":{"a":1}}}]}',
    "1" * 10_000, '{"choices":"abc"}', '{"choices":[null]}', "[]", "null", "", "\x00", '{"choices":[{"message":[]}]}',
    '{"choices":[{"message":{"content":"ok"}}],"usage":{"completion_tokens":true,"prompt_tokens":1e400}}',
    '{"choices":[{"message":{"content":"' + "\\ud800" * 3 + '"}}]}', "\ufeff{}", '{"a":' * 5000,
]


@pytest.mark.parametrize("body", ODD_BODIES, ids=lambda b: repr(b)[:30])
def test_odd_bodies_are_per_sample_failures(body: str) -> None:
    result, _ = parse_response(body)
    assert isinstance(result, CaptionResult)
    assert result.reason in ("bad_response", "empty_caption") or result.caption in ("ok",)
    label = label_from_reply(Reply(body, 1), 1.0)
    assert isinstance(label, LabelResult) and (label.error is not None)
    try:
        parse_chat(body)
    except BadResponse:
        pass


def test_reported_shapes_name_the_problem() -> None:
    assert parse_response(nested(100_000))[0].error.startswith("bad_response: RecursionError")
    assert parse_response('{"choices":[{"message":{"content":[{"text":5}]}}]}')[0].error == \
        "bad_response: message content is a list of int"
    assert label_from_reply(Reply(nested(100_000), 1), 1.0).error.startswith("bad_response: RecursionError")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=30)
CONTENT = st.one_of(JSON, st.lists(st.dictionaries(st.sampled_from(["text", "type"]), JSON, max_size=2), max_size=3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.one_of(JSON, CONTENT.map(lambda c: {"choices": [{"message": {"content": c}}]}),
                       st.tuples(CONTENT, JSON).map(lambda p: {"choices": [{"message": {"content": p[0]}}], "usage": p[1]})),
       raw=st.text(max_size=200))
def test_parsers_never_raise_on_arbitrary_json_or_text(value: object, raw: str) -> None:
    for body in (json.dumps(value), raw, json.dumps(value)[:-1]):
        result, usage = parse_response(body)
        assert isinstance(result, CaptionResult) and (usage is None or all(isinstance(v, int) for v in usage.values()))
        label = label_from_reply(Reply(body, 1), 1.0)
        assert isinstance(label, LabelResult) and (label.label in LABELS) != (label.error is not None)
        assert isinstance(result_from_answer(value), LabelResult)
        try:
            parse_chat(body)
        except BadResponse:  # the one documented failure of the shared parser
            pass
