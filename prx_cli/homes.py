"""One Dagster home per corpus root, and the root recorded on every build run.

A home shared by two roots mixes their runs: the UI's "latest materialization" of `samples
[photos]` could describe another corpus. So when DAGSTER_HOME is not set, the home of a local root
is `<root>/_state/dagster` (beside the root's other state: it moves and is deleted with the
corpus), and that of an object-store root, where SQLite cannot live, is a local folder named
after it: `<checkout>/.prx/dagster/<digest of the root>`. Every `prx-corpus build` run carries
the tag `prx/root`; a home already holding runs of another root gets a one-line warning.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import dagster as dg

from prx_assets.settings import REPO
from prx_core.store.storage import is_remote, normalize_root

ROOT_TAG = "prx/root"


corpus_root = normalize_root  # the root as runs record it (the name the CLI imports)


def default_home(root: str) -> Path:
    """Where the Dagster instance of `root` lives when DAGSTER_HOME is not set."""
    root = corpus_root(root)
    if is_remote(root):
        return REPO / ".prx" / "dagster" / hashlib.sha256(root.encode()).hexdigest()[:16]
    return Path(root) / "_state" / "dagster"


def root_tags(root: str) -> dict[str, str]:
    """The run tag naming the corpus a run built (filterable in the UI's run list)."""
    return {ROOT_TAG: corpus_root(root)}


def other_roots(instance: dg.DagsterInstance, root: str) -> list[str]:
    """The roots other than `root` whose runs this instance holds (one indexed tag query)."""
    mine = corpus_root(root)
    return sorted({value for key, values in instance.get_run_tags(tag_keys=[ROOT_TAG]) if key == ROOT_TAG
                   for value in values if value != mine})


def warn_other_roots(instance: dg.DagsterInstance, root: str, home: str, echo: Callable[..., None] = print) -> None:
    """One line when this home already holds runs of another corpus root."""
    if others := other_roots(instance, root):
        echo(f"warning: dagster home {home} holds runs of corpus root {', '.join(others)}, not only of root "
             f"{corpus_root(root)}: the UI's latest materializations may describe either corpus (use one home "
             f"per root: with DAGSTER_HOME and --dagster-home unset, {default_home(root)})", flush=True)
