"""Opt-outs a server states for one image, read the way img2dataset reads them by default.

An `X-Robots-Tag` response header refuses the image when it carries one of `OPT_OUT_DIRECTIVES`
(case-insensitive; img2dataset's defaults `noai`, `noimageai`, `noindex`, `noimageindex`, plus
`none`, which the robots convention defines as `noindex, nofollow`). A header scoped to a user
agent (`X-Robots-Tag: otherbot: noai`) applies only when that agent is ours: the product token
of `DownloadSettings.user_agent` (`prx-corpus`), or one of `DownloadSettings.opt_out_agents`
(`img2dataset` by default: sites that opted out of LAION-style crawls addressed it). Every
`X-Robots-Tag` header of the response counts; `unavailable_after: <date>` and the `max-*: <n>` directives are values, not agents.
"""

from __future__ import annotations

from collections.abc import Iterable

OPT_OUT_DIRECTIVES = frozenset({"noai", "noimageai", "noindex", "noimageindex", "none"})
_VALUE_DIRECTIVES = frozenset({"unavailable_after", "max-snippet", "max-image-preview", "max-video-preview"})


def agent_token(user_agent: str) -> str:
    """The product token a scoped directive names us by: `prx-corpus` of `prx-corpus/0.1 (...)`."""
    return user_agent.strip().split("/", 1)[0].split(None, 1)[0].lower()


def opt_out(headers: Iterable[str], agents: str | Iterable[str]) -> str | None:
    """The first `X-Robots-Tag` directive among `headers` (the header's values) that refuses the
    image for any of user agents `agents` (ours, and those the source's `opt_out_agents` adds), as
    the header gave it; None when the image may be used."""
    names = {agents.lower()} if isinstance(agents, str) else {a.lower() for a in agents}
    for value in headers:
        scope, directives = _scoped(value)
        if scope is not None and scope not in names:
            continue
        for directive in directives:
            if directive in OPT_OUT_DIRECTIVES:
                return value.strip()[:100]
    return None


def _scoped(value: str) -> tuple[str | None, list[str]]:
    """(the user agent a header value is scoped to, or None; its directives, lower case)."""
    scope = None
    head, colon, rest = value.partition(":")
    token = head.strip().lower()
    if colon and token and " " not in token and "," not in token and token not in _VALUE_DIRECTIVES:
        scope, value = token, rest
    directives = [part.split(":", 1)[0].strip().lower() for part in value.split(",")]
    return scope, [d for d in directives if d]
