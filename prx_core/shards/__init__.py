"""Mosaic Data Shards: writing and reading streams, skip-lists, the training loader."""
