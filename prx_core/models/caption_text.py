"""Captions are untrusted text: one cleaning rule and one length cap for every caption stored.

Source captions (at ingest, prx_core.sources.ingest) and generated ones (every captioner backend,
before storage) go through `clean_caption`, so what the labeller, the explorer and MDS see is
bounded and printable whatever a source or a model produced:
  * removed: C0 and C1 control characters (NUL, ESC and terminal escapes, DEL, ...) and lone
    surrogates (not text; they cannot even be encoded as UTF-8);
  * line breaks (CR LF, CR, NEL, U+2028, U+2029) become "\\n"; tab, vertical tab, form feed and
    the file/group/record/unit separators become a space;
  * runs of spaces and tabs become one space, lines are trimmed, at most one blank line is kept,
    and the text is stripped;
  * every other character (any script, emoji, joiners, bidi marks) is kept as is;
  * longer than `max_chars`: cut at the last word boundary within the last quarter of the cap,
    else at the cap (text without spaces, such as Chinese), never inside a combining sequence.
A caption that is empty after cleaning is no caption (None).

`DEFAULT_MAX_CAPTION_CHARS` = 2,000: about 500 tokens of English, already more than the text
encoders of image generators read (CLIP 77 tokens, T5 256-512), and more than any dense VLM
caption (`max_new_tokens` 256 is ~1,000-1,400 characters); it keeps the llm labeller's request
(instruction + caption) inside a 2,048-token context. Ingest is not the place to lose text a
model could use, so the cap is generous; it exists to bound memory and prompts.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

DEFAULT_MAX_CAPTION_CHARS = 2_000
MIN_MAX_CAPTION_CHARS = 16  # below this a cap is a configuration mistake, not a policy
WORD_BOUNDARY_SLACK = 4  # cut at a word boundary if one is within the last 1/4 of the cap

_LINE_BREAKS = re.compile("\r\n|[\r\x85\u2028\u2029]")
_SPACE_CONTROLS = re.compile("[\x0b\x0c\x1c-\x1f]")  # whitespace to Python, a space here
_DROPPED = re.compile("[\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f\ud800-\udfff]")  # other C0, DEL, C1, surrogates
_FLAGGED = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029]")  # what counts as "cleaned"
_SPACES = re.compile("[ \t]+")
_BLANK_LINES = re.compile("\n{3,}")
_JOINERS = frozenset("\u200c\u200d") | frozenset(chr(c) for c in range(0xFE00, 0xFE10))  # ZWNJ, ZWJ, variation selectors
WORD_PATTERN = r"\w+"  # a caption's words, for every rule that counts or reads them: runs of word characters
WORDS = re.compile(WORD_PATTERN)


def words(text: str) -> list[str]:
    """The lower-cased words of a text, in order: what the caption checks count and the labeller's
    head reads."""
    return WORDS.findall(str(text).lower())


@dataclass(frozen=True)
class CleanCaption:
    """The caption to store (None: no caption) and what was done to it (for the counts)."""

    text: str | None
    cleaned: bool = False  # it held control characters, lone surrogates or unusual line breaks
    truncated: bool = False  # it was longer than the cap


def check_max_chars(max_chars: int) -> int:
    """The cap, validated: an operator's mistake is a clear error, not silently empty captions."""
    if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < MIN_MAX_CAPTION_CHARS:
        raise ValueError(f"max_caption_chars must be an integer >= {MIN_MAX_CAPTION_CHARS}, got {max_chars!r}")
    return max_chars


def clean_caption(text: object, max_chars: int = DEFAULT_MAX_CAPTION_CHARS) -> CleanCaption:
    """`text` cleaned and capped as the module docstring says; never raises on any str or None
    (a non-str value, e.g. bytes from a foreign column, is decoded or turned into str first)."""
    if text is None:
        return CleanCaption(None)
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    elif not isinstance(text, str):
        text = str(text)
    # Work on a bounded prefix: cleaning removes characters, so keep some slack; anything longer
    # is over the cap whatever it holds (and cleaning a 1 GB string is not our business).
    limit = 4 * max_chars + 1024
    overlong = len(text) > limit
    text = text[:limit]
    flagged = _FLAGGED.search(text) is not None
    if flagged:
        text = _DROPPED.sub("", _SPACE_CONTROLS.sub(" ", _LINE_BREAKS.sub("\n", text)))
    elif "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _SPACES.sub(" ", text)
    if "\n" in text:
        text = _BLANK_LINES.sub("\n\n", "\n".join(line.strip(" ") for line in text.split("\n")))
    text = text.strip()
    truncated = overlong or len(text) > max_chars
    if truncated:
        text = cut_at_word(text, max_chars)
    return CleanCaption(text or None, flagged, truncated)


def cut_at_word(text: str, max_chars: int) -> str:
    """At most `max_chars` characters of `text`: up to the last whitespace if it is within the
    last quarter of the cap, else a hard cut moved back before any combining mark or joiner."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    if not text[max_chars].isspace():
        space = max(head.rfind(" "), head.rfind("\n"))
        if space >= max_chars - max_chars // WORD_BOUNDARY_SLACK:
            head = head[:space]
        else:
            end = max_chars
            while end > 0 and (unicodedata.combining(text[end]) or text[end] in _JOINERS or text[end - 1] in _JOINERS):
                end -= 1
            head = text[:end]
    return head.rstrip()
