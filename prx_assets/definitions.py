"""Dagster definitions for the corpus (loaded by workspace.yaml).

The asset graph (raw_source -> samples -> captions ... -> mds_shards, skip_lists) is added stage
by stage, one module per stage, by the asset-graph issue.
"""

import dagster as dg

defs = dg.Definitions()
