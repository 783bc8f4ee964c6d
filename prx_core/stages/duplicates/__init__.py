"""The global `duplicates` stage: groups of copies of one picture across every source.

- `stage`: the declaration (`DUPLICATES`), its settings and report, and which way a run goes;
- `state`: what a run remembers for the next (which sources changed since);
- `runs`: the two ways, full and incremental, as layers of Ray tasks over buckets;
- `tasks`: the Ray tasks of those layers; `units`: the work units after them (a bucket's groups
  written, an affected fragment's previous rows deleted);
- `groups`: what they compute, pure functions (candidate pairs, confirmation, groups cut around keepers);
- `check`: the keeper check (`duplicates_one_keeper`) as an aggregate on Ray workers.
"""
