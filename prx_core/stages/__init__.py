"""The pipeline stages: what a Dagster asset (or a script) calls to build a table.

A stage of one module is a module here (`buckets`, `phashes`, `labels`, ...); a stage of several
is a package (`samples/`, `mds_shards/`, `skip_lists/`, `duplicates/`, `captions/`, `explorer/`)
whose `stage` module declares it; `plan/` and `opt_out/` serve those commands. Each stage is run
by `stage.run_partition`: it takes a `Storage`, reads what it needs, runs its image work on Ray
through `prx_core.compute`, writes its Lance table in one commit per table and returns a report
the caller turns into metadata. No dagster here: the same calls run from a notebook.
"""
