"""Quality verdicts on captions before they are stored: pure functions of the text (and, for a
generated caption, why the model stopped), so every backend and every stage judge alike.

A VLM at scale writes some captions that must not be trained on: greedy decoding of Qwen VLMs
falls into loops on some images and runs to the token cap, a model refuses or apologises, echoes
the prompt, leaks chat special tokens, or answers with a line where a paragraph was asked. A
generated caption gets the first problem found, in this order (the most telling first):

  empty           nothing left after cleaning
  special_tokens  chat or tokenizer special tokens in the text (<|im_end|>, </s>, [INST], <image>)
  refusal         a refusal or an apology instead of a description ("I'm sorry, I can't ...")
  prompt_echo     a run of PROMPT_ECHO_WORDS words of the prompt repeated back
  repetition      a loop: an n-gram repeated back to back, a character run, or a text of few distinct 3-grams
  token_cap       the model was stopped by `max_new_tokens` (finish_reason "length"), not by itself
  too_long        more than `max_words` words
  too_short       fewer than `min_words` words

A source caption is only looked at, never refused (it belongs to its sample): `boilerplate` (a
file name, a camera's frame number, a URL, "untitled", "image") and `too_long`; an empty one is
already `no_source_caption`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from prx_core.models.caption_text import WORDS, words
from prx_core.models.prompts import CAPTION_PROMPT

EMPTY = "empty"
SPECIAL_TOKENS = "special_tokens"
REFUSAL = "refusal"
PROMPT_ECHO = "prompt_echo"
REPETITION = "repetition"
TOKEN_CAP = "token_cap"
TOO_LONG = "too_long"
TOO_SHORT = "too_short"
BOILERPLATE = "boilerplate"
GENERATED_PROBLEMS = (EMPTY, SPECIAL_TOKENS, REFUSAL, PROMPT_ECHO, REPETITION, TOKEN_CAP, TOO_LONG, TOO_SHORT)
SOURCE_PROBLEMS = (BOILERPLATE, TOO_LONG)
PROBLEMS = (*GENERATED_PROBLEMS, BOILERPLATE)

# Verdicts stored with each caption (`captions.verdict`).
OK = "ok"  # passed the first time
RETRIED = "retried"  # the first answer was refused, the fallback decoding's passed
REJECTED = "rejected"  # refused twice: kept for inspection, never shipped (mds_shards: caption_rejected)
FLAGGED = "flagged"  # a source caption with a problem: shipped, counted
UNCHECKED = "unchecked"  # the captioner's `check_captions: false`: shipped as generated
VERDICTS = (OK, RETRIED, REJECTED, FLAGGED, UNCHECKED)

LENGTH = "length"  # the finish_reason of a generation stopped by the token cap (OpenAI, vLLM, ours)
STOP = "stop"

DEFAULT_MIN_WORDS = 30  # the prompt asks for 100-200 words; under 30 is not the paragraph PRX trains on
DEFAULT_MAX_WORDS = 300  # past 300 the model did not stop where asked (256 tokens are ~190 words)
PROMPT_ECHO_WORDS = 7  # consecutive prompt words a caption must repeat to be an echo
LOOP_NGRAM = 12  # longest phrase a back-to-back loop is looked for in
LOOP_REPEATS = {1: 4}  # a word four times in a row; a longer phrase three times
LOOP_DEFAULT_REPEATS = 3
DISTINCT_MIN_TRIGRAMS = 30  # below this a text is too short for the distinct-3-gram test
DISTINCT_MIN_SHARE = 0.5  # under half the 3-grams distinct: the text goes round in circles
CHAR_LOOP = re.compile(r"(\S.{0,11}?)\1{5,}", re.DOTALL)  # a unit of 1-12 characters six times in a row

_SPECIAL = re.compile(
    r"<\|[^<>|\s]{1,40}\|>|</?s>|<(?:unk|pad|eos|bos|image|video|start_of_turn|end_of_turn|pad_token)>"
    r"|\[/?INST\]|\[/?IMG\]|<(?:image|img)_?\d*>", re.IGNORECASE)
_REFUSAL_START = re.compile(
    r"^\W*(?:i'?m sorry|i am sorry|sorry\b|my apologies|i apologi[sz]e|unfortunately,? i\b|as an ai\b"
    r"|as a language model|i (?:can ?not|can't|cannot|am unable|'m unable|am not able|'m not able|won't|will not)\b"
    r"|i do(?: not|n't) (?:have the ability|see an image|have access))", re.IGNORECASE)
_REFUSAL_ANYWHERE = re.compile(r"\b(?:i'?m sorry|i apologi[sz]e),? but i\b", re.IGNORECASE)
_FILE_NAME = re.compile(r"^[\w\-. ()]{1,120}\.(?:jpe?g|png|gif|webp|bmp|tiff?|heic|avif|svg)$", re.IGNORECASE)
_FRAME_NUMBER = re.compile(r"^(?:img|dsc[nf]?|dcim|pict?|p|photo|image|screenshot|scan|mvimg|pxl)[\s_\-]*\d[\w\-]*$",
                           re.IGNORECASE)
_URL = re.compile(r"^(?:https?://|www\.)\S+$", re.IGNORECASE)
_GENERIC = frozenset({"image", "photo", "picture", "img", "untitled", "untitled image", "no title", "no description",
                      "description", "default", "thumbnail", "placeholder", "null", "none", "n/a", "na", "caption",
                      "alt", "alt text", "stock photo", "stock image", "photograph"})


@dataclass(frozen=True)
class Verdict:
    """The first problem found ("" when none) and a short message saying what was seen."""

    problem: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem


def check_generated(text: str | None, finish_reason: str | None = None, *, min_words: int = DEFAULT_MIN_WORDS,
                    max_words: int = DEFAULT_MAX_WORDS, prompt: str = CAPTION_PROMPT) -> Verdict:
    """A generated caption's verdict (`text` as stored: cleaned; `finish_reason` as the backend
    reported it, None where unknown)."""
    text = (text or "").strip()
    if not text:
        return Verdict(EMPTY, "nothing left after cleaning")
    if found := _SPECIAL.search(text):
        return Verdict(SPECIAL_TOKENS, f"special token {found.group(0)!r} in the text")
    if found := (_REFUSAL_START.search(text[:300]) or _REFUSAL_ANYWHERE.search(text[:600])):
        return Verdict(REFUSAL, f"refusal or apology: {found.group(0).strip()!r}")
    tokens = words(text)
    if echo := echoed(tokens, prompt):
        return Verdict(PROMPT_ECHO, f"repeats the prompt: {echo!r}")
    if loop := repeated(text, tokens):
        return Verdict(REPETITION, loop)
    if finish_reason == LENGTH:
        return Verdict(TOKEN_CAP, "stopped by the token cap (finish_reason=length)")
    count = len(text.split())
    if count > max_words:
        return Verdict(TOO_LONG, f"{count} words, more than {max_words}")
    if count < min_words:
        return Verdict(TOO_SHORT, f"{count} words, fewer than {min_words}")
    return Verdict()


def check_source(text: str | None, *, max_words: int = DEFAULT_MAX_WORDS) -> Verdict:
    """A source caption's verdict: metadata only (boilerplate alt-text, too long); never a refusal."""
    text = (text or "").strip()
    if not text:
        return Verdict()  # no caption at all is `no_source_caption`, counted by the captions stage
    plain = " ".join(text.lower().split()).strip(" .:-_")
    if plain in _GENERIC or _FILE_NAME.match(plain) or _FRAME_NUMBER.match(plain) or _URL.match(plain) \
            or not WORDS.search(plain) or plain.replace(" ", "").isdigit():
        return Verdict(BOILERPLATE, f"boilerplate alt-text: {text[:80]!r}")
    count = len(text.split())
    if count > max_words:
        return Verdict(TOO_LONG, f"{count} words, more than {max_words}")
    return Verdict()


@functools.lru_cache(maxsize=8)
def prompt_grams(prompt: str, span: int) -> frozenset[tuple[str, ...]]:
    said = words(prompt)
    return frozenset(tuple(said[i:i + span]) for i in range(len(said) - span + 1))


def echoed(tokens: list[str], prompt: str = CAPTION_PROMPT, span: int = PROMPT_ECHO_WORDS) -> str:
    """The first `span` consecutive words of `tokens` that also follow each other in `prompt`, or ""."""
    grams = prompt_grams(prompt, span)
    for i in range(len(tokens) - span + 1):
        if tuple(tokens[i:i + span]) in grams:
            return " ".join(tokens[i:i + span])
    return ""


def repeated(text: str, tokens: list[str]) -> str:
    """What makes the text a loop ("" when nothing does): a phrase of up to LOOP_NGRAM words back
    to back (a word 4 times, a phrase 3), a 1-12 character unit six times in a row, or a long text
    with fewer than half of its word 3-grams distinct."""
    for n in range(1, LOOP_NGRAM + 1):
        need = n * (LOOP_REPEATS.get(n, LOOP_DEFAULT_REPEATS) - 1)  # matching positions i, i+n in a row
        run = 0
        for i in range(len(tokens) - n):
            run = run + 1 if tokens[i] == tokens[i + n] else 0
            if run >= need:
                phrase = " ".join(tokens[i + 1 - need: i + 1 - need + n])
                return f"{phrase!r} repeated {need // n + 1} times in a row"
    if found := CHAR_LOOP.search(text):
        unit = found.group(1)
        if WORDS.search(unit):
            return f"{unit!r} repeated {len(found.group(0)) // len(unit)} times in a row"
    share = distinct_share(tokens)
    if share is not None and share < DISTINCT_MIN_SHARE:
        return f"only {share:.0%} of its word 3-grams are distinct"
    return ""


def distinct_share(tokens: list[str]) -> float | None:
    """Distinct word 3-grams over all of them; None for a text too short to tell."""
    grams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    if len(grams) < DISTINCT_MIN_TRIGRAMS:
        return None
    return len(set(grams)) / len(grams)


def repetition_score(text: str | None) -> float:
    """0 (no repeated 3-gram) to ~1 (one phrase over and over): 1 - distinct 3-grams / 3-grams of
    the words, or of the characters where the text has under 3 words; the explorer's "most repetitive"."""
    tokens = words(text or "")
    if len(tokens) < 3:
        tokens = [c for c in (text or "") if not c.isspace()]
    grams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    return round(1 - len(set(grams)) / len(grams), 4) if grams else 0.0
