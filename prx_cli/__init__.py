"""The `prx-corpus` command line and the build it drives, beside the Dagster code location.

prx_assets is what Dagster loads (definitions, assets, checks, automation, resources); this package
launches its jobs in-process (`prx-corpus build`), prints plans and reports, and serves the explorer.
It may import prx_assets, prx_core, prx_resources and prx_explorer; none of them imports it.
"""
