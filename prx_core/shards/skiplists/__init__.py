"""Skip-lists: which samples of an MDS stream training must skip, and why, per stream and reason.

- `files`: the `.skip` format (a framed int64 array a loader maps), its `.ids.parquet` audit
  twin, where they live, written and read;
- `records`: `_complete.json`, the proof a stream's lists were computed for its current index;
- `publish`: a source's lists written in one process, then its part of the tier manifests.
"""
