"""Caption quality verdicts (issue 39, part 3): each reason on scripted model outputs, source
captions only flagged, and the retry with the fallback decoding on a scripted captioner: a second
refusal is `rejected`, a good second answer `retried`, a failure stays a failure."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from prx_core.models.caption_base import EMPTY_CAPTION, CaptionerConfig, Captioner, CaptionResult, generated_caption
from prx_core.models.caption_checks import (
    BOILERPLATE,
    EMPTY,
    LENGTH,
    PROMPT_ECHO,
    REFUSAL,
    REPETITION,
    SPECIAL_TOKENS,
    STOP,
    TOKEN_CAP,
    TOO_LONG,
    TOO_SHORT,
    check_generated,
    check_source,
    repetition_score,
)
from prx_core.models.captioning import CaptionBatch, checked_captions
from prx_core.models.captioning_openai import parse_response, request_body

GOOD = ("A photograph of a red brick lighthouse standing on a rocky headland under a pale blue sky. The tower "
        "occupies the centre of the frame and is topped by a black iron lantern room with a narrow gallery. To "
        "the left, grey waves break against dark boulders, throwing white spray into the air. In the foreground, "
        "tufts of dry yellow grass grow between flat stones. A small white keeper's cottage with a green door "
        "sits at the base of the tower on the right. Thin clouds streak across the upper part of the image, and "
        "the light comes from the left, casting short shadows to the right.")
LONG = GOOD + " " + " ".join(f"detail{i}" for i in range(250))  # over 300 words, none repeated


def test_a_good_paragraph_passes() -> None:
    assert 80 < len(GOOD.split()) < 200
    assert check_generated(GOOD, STOP).ok and check_generated(GOOD, None).ok
    assert repetition_score(GOOD) < 0.05


@pytest.mark.parametrize(("text", "finish", "problem"), [
    ("", STOP, EMPTY),
    ("   \n ", None, EMPTY),
    (None, None, EMPTY),
    (GOOD + " <|im_end|>", STOP, SPECIAL_TOKENS),
    ("</s> " + GOOD, STOP, SPECIAL_TOKENS),
    ("[INST] describe [/INST] " + GOOD, STOP, SPECIAL_TOKENS),
    ("<image> " + GOOD, STOP, SPECIAL_TOKENS),
    ("I'm sorry, but I can't help with identifying people in images.", STOP, REFUSAL),
    ("Sorry, I cannot describe this image.", STOP, REFUSAL),
    ("As an AI language model, I do not have the ability to see images. " + GOOD, STOP, REFUSAL),
    ("I apologize, but the image appears to be blank. " + GOOD, STOP, REFUSAL),
    ("Unfortunately, I am unable to view the picture you sent.", STOP, REFUSAL),
    ("Describe this image in a single paragraph of 100 to 200 words. " + GOOD, STOP, PROMPT_ECHO),
    (GOOD + " Transcribe any visible text verbatim inside double quotes, keeping its spelling.", STOP, PROMPT_ECHO),
    ("g theads theads theads theads theads theads theads theads theads theads theads", LENGTH, REPETITION),
    ("A photograph of a street. " + "The car is red and the car is parked. " * 6, STOP, REPETITION),
    (GOOD[:300] + " and the wall, and the wall, and the wall, and the wall", LENGTH, REPETITION),
    ("A sign reads " + "ababababababababab" * 2 + ". " + GOOD, STOP, REPETITION),
    ("一只猫坐在窗台上" + "看着看着看着看着看着看着看着" + GOOD, STOP, REPETITION),
    (GOOD, LENGTH, TOKEN_CAP),
    (LONG, STOP, TOO_LONG),
    ("A photograph of a lighthouse on a rocky headland.", STOP, TOO_SHORT),
])
def test_each_problem_is_named(text: str | None, finish: str | None, problem: str) -> None:
    verdict = check_generated(text, finish)
    assert verdict.problem == problem, verdict
    assert verdict.detail


def test_natural_repeats_are_not_loops() -> None:
    """Words and short phrases a description repeats naturally are not a loop."""
    text = (GOOD + " The left window is open, the right window is closed, and the middle window is open. "
            "Very, very small birds sit on the roof.")
    assert check_generated(text, STOP).ok
    assert check_generated("A sign reads \"HAHAHA\" in red. " + GOOD, STOP).ok


def test_word_bounds_are_configurable() -> None:
    short = "A photograph of a lighthouse on a rocky headland."
    assert check_generated(short, STOP, min_words=5).ok
    assert check_generated(GOOD, STOP, max_words=50).problem == TOO_LONG


@pytest.mark.parametrize(("text", "problem"), [
    ("IMG_1234.JPG", BOILERPLATE), ("DSC00042", BOILERPLATE), ("photo.png", BOILERPLATE), ("untitled", BOILERPLATE),
    ("Image", BOILERPLATE), ("https://example.com/cat.jpg", BOILERPLATE), ("12345", BOILERPLATE), ("---", BOILERPLATE),
    (LONG, TOO_LONG), ("a dog on the beach", ""), ("cat", ""), ("I'm sorry for the blur", ""),
    ("", ""), (None, "")])
def test_source_captions_are_only_flagged(text: str | None, problem: str) -> None:
    """A source caption is never refused for its length, a refusal or an echo: only flagged."""
    assert check_source(text).problem == problem


class Scripted(Captioner):
    """A captioner whose answers are scripted per image and decoding: (first answer, fallback answer)."""

    def __init__(self, config: CaptionerConfig, script: dict[bytes, tuple[CaptionResult, CaptionResult]]) -> None:
        super().__init__(config)
        self.script, self.calls = script, []

    def caption_batch(self, images: Sequence[bytes], original_captions: Sequence[str | None],
                      fallback: bool = False) -> list[CaptionResult]:
        self.calls.append((list(images), fallback))
        return [self.script[image][1 if fallback else 0] for image in images]


def answer(text: str, finish: str = STOP, tokens: int = 10) -> CaptionResult:
    return generated_caption(text, 2000, tokens, finish_reason=finish)


LOOP = "g theads theads theads theads theads theads theads theads"
SCRIPT = {
    b"good": (answer(GOOD), answer("unused")),
    b"loop-then-good": (answer(LOOP, LENGTH, 256), answer(GOOD, STOP, 120)),
    b"loop-twice": (answer(LOOP, LENGTH, 256), answer(GOOD, LENGTH, 256)),
    b"refusal-then-empty": (answer("I'm sorry, I can't describe this."), answer("   ")),
    b"broken": (CaptionResult.failed("decode_error", "not an image"), answer("unused")),
    b"fails-on-retry": (answer(LOOP), CaptionResult.failed("http_error", "500")),
}


def test_a_refused_caption_is_retried_once_with_the_fallback_decoding() -> None:
    config = CaptionerConfig("openai", model="m", endpoint="http://127.0.0.1:1/v1")
    captioner = Scripted(config, SCRIPT)
    images = list(SCRIPT)
    checked = dict(zip(images, checked_captions(captioner, images, [None] * len(images))))
    assert [(calls, fallback) for calls, fallback in captioner.calls] == [
        (images, False), ([b"loop-then-good", b"loop-twice", b"refusal-then-empty", b"fails-on-retry"], True)]
    summary = {k: (c.verdict, c.problem, c.attempts, c.result.caption or c.result.error) for k, c in checked.items()}
    assert summary[b"good"] == ("ok", "", 1, GOOD)
    assert summary[b"loop-then-good"] == ("retried", REPETITION, 2, GOOD)  # why it was retried
    assert summary[b"loop-twice"] == ("rejected", TOKEN_CAP, 2, GOOD)  # the last answer, kept for inspection
    assert summary[b"refusal-then-empty"][:3] == ("rejected", EMPTY, 2)
    assert summary[b"broken"] == ("", "", 1, "decode_error: not an image")  # a failure: retried next run
    assert summary[b"fails-on-retry"][:3] == ("", REPETITION, 2)
    assert checked[b"loop-then-good"].tokens == 376 and checked[b"loop-twice"].result.finish_reason == LENGTH
    assert checked[b"refusal-then-empty"].result.reason is None  # a rejected row is no failure: never retried


def test_caption_batch_stores_the_verdict_columns() -> None:
    config = CaptionerConfig("openai", model="m", endpoint="http://127.0.0.1:1/v1")
    batch = CaptionBatch.__new__(CaptionBatch)  # the callable without building a client
    batch.config, batch.captioner_id, batch.version = config, config.captioner_id(), config.version()
    batch.captioner = Scripted(config, SCRIPT)
    out = batch({"content_id": ["a", "b", "c"], "image": [b"good", b"loop-twice", b"broken"]})
    assert list(out["verdict"]) == ["ok", "rejected", ""] and list(out["problem"]) == ["", TOKEN_CAP, ""]
    assert list(out["attempts"]) == [1, 2, 1] and list(out["finish_reason"]) == [STOP, LENGTH, ""]
    assert list(out["error"]) == ["", "", "decode_error: not an image"] and out["caption"][1] == GOOD


def test_checks_off_store_captions_unchecked_and_source_captions_are_flagged() -> None:
    config = CaptionerConfig("openai", model="m", endpoint="http://127.0.0.1:1/v1", check_captions=False)
    assert config.version() != CaptionerConfig("openai", model="m", endpoint="http://x:1/v1").version()
    checked = checked_captions(Scripted(config, SCRIPT), [b"loop-twice"], [None])
    assert (checked[0].verdict, checked[0].attempts) == ("unchecked", 1)
    from prx_core.models.captioning import SourceCaptioner

    source = SourceCaptioner(CaptionerConfig("source"))
    flagged = checked_captions(source, [b""] * 3, ["IMG_0001.jpg", "a dog on a beach", None])
    assert [(c.verdict, c.problem, c.attempts) for c in flagged] == [("flagged", BOILERPLATE, 0), ("ok", "", 0),
                                                                      ("", "", 0)]


def test_fallback_settings_enter_the_version_only_when_changed() -> None:
    base = CaptionerConfig("openai", model="m", endpoint="http://h:1/v1")
    assert CaptionerConfig("openai", model="m", endpoint="http://h:1/v1", min_words=30, max_words=300,
                           fallback_repetition_penalty=1.2).version() == base.version()
    changed = [CaptionerConfig("openai", model="m", endpoint="http://h:1/v1", **kw).version() for kw in (
        {"min_words": 10}, {"max_words": 250}, {"fallback_repetition_penalty": 1.0}, {"fallback_temperature": 0.3})]
    assert len(set(changed)) == 4 and base.version() not in changed
    assert CaptionerConfig("source").version().startswith("source-")
    with pytest.raises(ValueError, match="min_words"):
        CaptionerConfig("source", min_words=50, max_words=10)


def test_openai_reports_finish_reason_and_sends_the_fallback_decoding() -> None:
    body = '{"choices": [{"message": {"content": "%s"}, "finish_reason": "length"}]}' % LOOP
    result, _ = parse_response(body)
    assert (result.caption, result.finish_reason) == (LOOP, LENGTH)
    assert parse_response('{"choices": [{"message": {"content": "x"}}]}')[0].finish_reason is None
    assert parse_response('{"choices": [{"message": {"content": ""}, "finish_reason": "stop"}]}')[0].reason == EMPTY_CAPTION
    config = CaptionerConfig("openai", model="m", endpoint="http://h:1/v1", fallback_temperature=0.3)
    plain, retry = request_body(config, b"jpeg"), request_body(config, b"jpeg", fallback=True)
    assert "repetition_penalty" not in plain and plain["temperature"] == 0.0
    assert (retry["repetition_penalty"], retry["temperature"], retry["seed"]) == (1.2, 0.3, 0)
