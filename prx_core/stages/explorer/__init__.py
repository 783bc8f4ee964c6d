"""The `explorer` stage: one denormalized row per sample and ingest reject of a source, and its facets.

- `stage`: the declaration (`EXPLORER`): the tables it joins pinned, row units, one commit per table;
- `rows`: a unit's rows (a `samples` range, or ingest rejects, joined with every table by key) and
  the facet counts and histograms; the explorer (prx_explorer) reads its column names and bins too.
"""
