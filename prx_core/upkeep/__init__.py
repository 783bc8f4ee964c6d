"""Upkeep of the store that runs Ray work: compaction, batched appends. Above `compute`, below the stages."""
