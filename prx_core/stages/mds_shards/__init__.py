"""The `mds_shards` stage: a source's Mosaic Data Shards, one stream per bucket, and `mds_index`.

- `stage`: the declaration (`MDS_SHARDS`): pins its inputs, runs three passes of units, commits
  `mds_index`; `settings`: its settings;
- `route`: the first pass, rows bucketed and sorted into scratch, and the chunks cut from them;
- `chunks`: a chunk folder written (images resized and re-encoded, captions joined), with
  `latents`: the text latents a chunk stores when configured;
- `index`: the last pass, each chunk's `mds_index` rows and rejects;
- `report`: what a run reports, and the read-back of the published streams after its commit.
"""
