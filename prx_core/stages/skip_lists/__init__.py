"""The `skip_lists` stage: per stream and reason, the positions training skips, shards untouched.

- `stage`: the declaration (`SKIP_LISTS`), the skip policy, its report and its steps;
- `units`: its work units: a chunk's skipped positions by reason, then a stream's lists from them.
"""
