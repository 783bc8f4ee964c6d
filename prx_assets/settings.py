"""Which corpus the definitions build, from the environment (and an optional YAML file).

`PRX_ROOT` (corpus root, local or s3://), `PRX_SOURCES` (the catalog) and `PRX_CONFIG` (a YAML
file with resource fields: storage, captioner, labeler, skip_policy, ray) are read once when
the code location loads, because the captioner, labeler and policy settings become the
`code_version`s of their assets. The defaults are the demo that `make demo` builds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = REPO / ".prx" / "demo" / "corpus"
DEFAULT_SOURCES = REPO / ".prx" / "demo" / "sources" / "sources.yaml"
SECTIONS = ("storage", "captioner", "labeler", "skip_policy", "ray")


@dataclass(frozen=True)
class Settings:
    root: str
    sources: str
    config: dict[str, dict[str, Any]] = field(default_factory=dict)

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.config.get(name) or {})


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    config: dict[str, dict[str, Any]] = {}
    if path := env.get("PRX_CONFIG"):
        config = yaml.safe_load(Path(path).read_text()) or {}
        unknown = sorted(set(config) - set(SECTIONS))
        if unknown:
            raise ValueError(f"{path}: unknown sections {unknown}; expected some of {list(SECTIONS)}")
    return Settings(root=env.get("PRX_ROOT", str(DEFAULT_ROOT)), sources=env.get("PRX_SOURCES", str(DEFAULT_SOURCES)),
                    config=config)
