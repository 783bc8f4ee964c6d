"""The name rule of sources and assets: a partition key and a path segment under the corpus root.

It lives on the ground floor because the store turns names into paths (locks, partitions, runs,
streams) and every floor above checks names before they reach one.
"""

from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"^[a-z0-9_]+$")
MERGED = "_merged"  # the pseudo-source of merged small streams (`prx_core.shards.mds.merged`): no catalog source


def validate_source_name(name: object) -> str:
    """`name` if it is a valid source name (the partition key, a path segment under the corpus
    root), else ValueError: a key like `..` or `a/b` must never reach a path or a deletion."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"invalid source name {name!r}: a source name must match [a-z0-9_]+ "
                         "(it is the partition key and a folder name under the corpus root)")
    return name
