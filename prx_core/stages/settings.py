"""A stage's settings as a typed, frozen dataclass, and the four things the runner does with them.

Each stage declares its settings beside its `Stage` as a subclass of `Settings`, a frozen,
keyword-only dataclass: a field with a default is optional, one without is mandatory, and
declaration order is free (so a mandatory field may stand where it reads best). The steps read
`run.settings.unit_rows`, so a misspelt setting fails where it is written, not at run time.

The manifest does not change with this: `pinned` builds the same flat dict of name -> value
(the dataclass's own values, never `asdict`, which would turn a nested `SourceSpec` into a dict)
that the string-keyed settings made, so every committed run and attempt keeps its digest
(tests/core/stages/test_stage_settings.py pins them).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Self


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """The base of every stage's settings (`@dataclass(frozen=True, kw_only=True)` subclasses)."""

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Self:
        """The settings a worker reads back from its manifest's params: the pinned fields as the
        driver pinned them, the unpinned ones (never in the manifest) at their defaults. A
        mandatory field the manifest does not hold in its own type (a stage's `pin` may replace
        it, e.g. a spec by its dict) needs the stage's own override."""
        return cls(**{f.name: params[f.name] for f in dataclasses.fields(cls) if f.name in params})


def names(cls: type[Settings]) -> tuple[str, ...]:
    """The settings of `cls`, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls))


def defaults(cls: type[Settings]) -> dict[str, Any]:
    """Each optional setting's default (a mandatory one has none)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def types(cls: type[Settings]) -> dict[str, Any]:
    """Each setting's declared type, resolved (what the wire must be able to carry)."""
    hints = typing.get_type_hints(cls)
    return {name: hints[name] for name in names(cls)}


def bind(stage: str, cls: type[Settings], given: Mapping[str, Any]) -> Settings:
    """`cls` from the keyword settings `given`; an unknown or missing one fails naming them all."""
    known = names(cls)
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"{stage}: unknown setting(s) {', '.join(unknown)}; settings: {', '.join(known)}")
    missing = sorted(k for k in known if k not in given and k not in defaults(cls))
    if missing:
        raise TypeError(f"{stage}: missing setting(s) {', '.join(missing)}")
    return cls(**given)


def pinned(settings: Settings, unpinned: Iterable[str]) -> dict[str, Any]:
    """The manifest's params from `settings`: a flat dict of each field's own value (not `asdict`:
    a nested dataclass stays itself, as the string-keyed settings held it), the unpinned left out."""
    left_out = set(unpinned)
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name not in left_out}


def check_declared(stage: str, cls: Any, *named: Iterable[str]) -> None:
    """At declaration: `cls` is a `Settings` dataclass (frozen: a dataclass can only inherit a frozen
    one frozen) and every setting the stage names elsewhere (its unit sizes, its unpinned settings)
    is one of its fields."""
    if not (isinstance(cls, type) and issubclass(cls, Settings) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{stage}: settings must be a Settings dataclass, not {cls!r}")
    known = set(names(cls))
    unknown = sorted({n for group in named for n in group} - known)
    if unknown:
        raise TypeError(f"{stage}: {', '.join(unknown)} named but not a field of {cls.__name__} "
                        f"({', '.join(names(cls))})")
