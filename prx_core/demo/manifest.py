"""The demo's manifest: every planted sample, what it is and where the pipeline should send it
(`manifest.json` beside the sources; tests check each planted case ends where it should)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Planted:
    """One demo sample as planted: what it is and where the pipeline should send it."""

    source: str
    key: str
    kinds: list[str]
    caption: str
    size: tuple[int, int] | None  # upright (width, height) when decodable
    format: str
    reject: str | None = None  # expected reject reason code
    group: str | None = None  # duplicate group id
    role: str | None = None  # original | reencode | resize50 | copy


@dataclass
class DemoManifest:
    root: str
    samples: list[Planted] = field(default_factory=list)

    def kinds(self) -> Counter:
        return Counter(kind for s in self.samples for kind in s.kinds)

    def by_source(self) -> Counter:
        return Counter(s.source for s in self.samples)


def load_manifest(out_dir: str | Path) -> DemoManifest:
    rows = json.loads((Path(out_dir) / "manifest.json").read_text())
    samples = [Planted(**{**r, "size": tuple(r["size"]) if r["size"] else None}) for r in rows]
    return DemoManifest(root=str(Path(out_dir).resolve()), samples=samples)
