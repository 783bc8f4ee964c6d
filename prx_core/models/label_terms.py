"""Explicit terms: a curated list of words and phrases that only explicit captions use, which force
`nsfw` in the `minilm` head labeller (`LabelerConfig.explicit_terms`, on by default for the head).

Why: MiniLM's word pieces do not carry porn slang. On short source captions the head gave
"Woman giving a handjob in a car" p(nsfw) 0.02, while plain words ("naked", "penis") it reads
well. Recall comes first for explicit images (a missed one costs more than a skipped borderline
one), so a caption naming a sex act or a porn genre is `nsfw` whatever the embedding says; the head
still decides everything else, plain-word explicit captions included.

What is on the list, and what is not: terms of sex acts, porn genres and sexual slang that have no
common innocent reading. Anatomy and art words (nude, naked, breast, nipple, penis, vagina,
genitals, topless, erection) are NOT here: art nudes, sculpture, anatomy diagrams, sex education
and breastfeeding use them, and the head tells those apart. Words with an innocent reading are
only listed in the context that removes it: "pussy" not before cat or willow, "cock", "dick" and
"tits" only after a possessive, an adjective or a verb of the act ("his cock", "sucking dick", not
"a cock crowing", "Moby Dick", "blue tits"), "creampie" as one word (not "banana cream pie"),
"fuck" only in the act ("getting fucked", not a swear on a protest sign), "strap-on" only before
dildo or sex. Matching is case-insensitive on word boundaries; a hyphen or space inside a compound
is optional ("blow-job", "blow job", "blowjob").

Measured (docs/benchmarks.md, "Caption labels"): no match on any of the labelled set's 906 visual
and text captions (every round, held out ones included), the labeller tests' calibration sets or
the demo's captions (tests/core/models/test_label_terms.py). The list's
digest enters the labeller version, so editing it re-labels the corpus; the head's thresholds were
chosen with the list applied (prx_core.models.label_head_train), so retrain after editing it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re

_H = r"[\s-]?"  # an optional hyphen or space inside a compound
_OWNER = r"(?:her|his|my|your|their|big|huge|hard|wet|erect|hairy|shaved|tight|oiled|sloppy|throbbing)"
_ACT = r"(?:suck\w*|lick\w*|eat\w*|strok\w+|rid(?:e|es|ing)|bouncing on|flash\w*|spread\w*|jerk\w*|finger\w*|rub\w*)"
_SLANG = r"(?:pussy|pussies|cocks?|dicks?|tits|clit)"

EXPLICIT_TERMS: tuple[str, ...] = (
    # porn as such
    r"porn\w*", r"hentai", r"rule ?34", r"nsfw", r"milfs?",
    # acts
    rf"(?:hand|blow|foot|rim){_H}jobs?", rf"cum{_H}shots?", r"cumming", r"creampie[sd]?", r"deepthroat\w*",
    r"deep throating", rf"gang{_H}bang\w*", r"bukkake", r"gloryholes?", r"fellatio", r"cunnilingus", r"anilingus",
    r"masturbat\w+", r"(?:jerk|jack)(?:s|ed|ing)? off", r"fingering (?:herself|himself|themselves|each other)",
    rf"doggy{_H}style", r"reverse cowgirl", r"cowgirl (?:sex|position)", r"missionary position",
    rf"sixty{_H}nining|69ing|69 position", r"threesome", r"double penetrat\w+", r"dildos?", rf"strap{_H}on (?:dildo|sex)",
    rf"butt{_H}plugs?", r"squirting orgasm", r"tribbing", r"eat(?:s|ing)? (?:her|him) out",
    r"(?:sits?|sitting) on (?:his|her|a man's|a woman's) face",
    r"(?:anal|oral|group|public|lesbian|gay|rough|hardcore|amateur|bareback|passionate) sex",
    r"sex (?:scene|tape|video|act|toy)s?", r"(?:having|have|has|had) sex", r"(?:sexual|having) intercourse",
    r"(?:explicit|uncensored|hardcore) (?:sex|nude|nudity|porn)", r"full frontal",
    # "fuck" in the act only
    r"(?:being|getting|gets|got) (?:fucked|creampied|banged|railed)",
    r"fuck(?:s|ed|ing)? (?:her|him|them|each other|hard|from behind)", r"fucked (?:hard|from behind|by)",
    r"(?:titty|tit|face|anal) fuck\w*", r"cowgirl fuck\w*", r"fucking (?:in|on)",
    # slang for genitals and breasts, in context
    r"puss(?:y|ies)(?!\s*(?:cats?|willows?|riot|foot\w*|galore))", rf"{_OWNER} {_SLANG}",
    rf"{_ACT} (?:(?:her|his|a|the) )?{_SLANG}", r"(?:cock|dick|tits) (?:visible|out|on show|sucking)", rf"dick{_H}pics?",
)


@functools.cache
def _pattern() -> re.Pattern[str]:
    return re.compile(r"\b(?:" + "|".join(EXPLICIT_TERMS) + r")\b", re.IGNORECASE)


def explicit_term(caption: str | None) -> str | None:
    """The first explicit term in the caption, as written there; None when it has none."""
    if not caption:
        return None
    found = _pattern().search(str(caption))
    return found.group(0) if found else None


def terms_digest() -> str:
    """SHA-256 of the list: part of the labeller version and of the head's training record."""
    return hashlib.sha256(json.dumps(list(EXPLICIT_TERMS)).encode()).hexdigest()
