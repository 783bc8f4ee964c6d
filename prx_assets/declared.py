"""An asset's `deps` and code version, from its stage's one declaration (prx_core.stages.stage.Stage).

The stage names the assets it follows (`after`) and its code version, which its manifests carry;
the asset takes both from there, so neither its graph nor its code version can drift from the code
it runs (tests/assets/test_stage_graph.py). Its code version is the stage's followed by the
resource settings that change its output: a new stage version marks the asset changed, as a new
setting does.
"""

from __future__ import annotations

from typing import Any

from prx_core.stages.entry import STAGES


def from_stage(name: str, *settings: str) -> dict[str, Any]:
    """`deps` and `code_version` of stage `name`'s asset (keywords of `dg.asset`): the assets its
    stage follows, and its stage's code version then `settings`, joined by "-"."""
    stage = STAGES[name]
    return {"deps": list(stage.after), "code_version": "-".join((stage.code_version, *settings))}
