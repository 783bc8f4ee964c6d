"""One module per pipeline stage: what a Dagster asset (or a script) calls to build a table.

Each `build_*` function takes a `Storage`, reads what it needs, runs its image work on Ray
through `prx_core.compute.parallel`, writes its Lance table in one commit per table and returns a
report the caller turns into metadata. No dagster here: the same calls run from a notebook.
"""
