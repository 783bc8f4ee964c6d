"""The corpus's Mosaic Data Shards: one stream per (source, tier, bucket), written in chunks.

- `streams`: the layout, a chunk folder written and its record, streams listed, indexes merged;
- `writer`: the files of streaming's `MDSWriter`, byte for byte, without importing streaming;
  `encodings`: the `bf16` encoding of text latents PRX's trainer registers;
- `publish`: a stream's index.json merged from its chunks and written last, in one step;
- `read`: streams read back in index order; `verify`, `sampled_read`: the read-back checks;
- `merged`: small streams merged into `_merged` (`training.small_streams: merge`);
- `rewrite`: one stream republished without some of its samples (takedowns, `rewrite-stream`);
- `retention`: superseded chunks removed a retention after no index references them.
"""
