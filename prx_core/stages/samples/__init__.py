"""The `samples` stage: one source ingested into the unified table, refusals into `rejects`.

- `stage`: the declaration (`SAMPLES`), its report and its steps; `settings`: its settings;
- `join_tables`: the tables a source joins, staged as key-indexed Lance tables before it is ingested;
- `units`: how a source is cut into units (by bytes, then by rows or files);
- `ingest`: the ingest unit, on a worker; `losses`: what a unit's lost reads become;
- `repeated_ids`: sample ids repeated across a source's files, settled after the commit;
- `refusals`: why a source yielded no sample, in one line an operator can act on.
"""
