"""Mosaic Data Shards: the streams (`mds/`), their skip-lists (`skiplists/`), the tier manifests
(`manifest`, `manifest_publish`, both framed like a `.skip`: `framed`) and the training loader
(`loader`, with `node_cache`, `substitutes` and `batching`)."""
