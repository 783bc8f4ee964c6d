"""prx_assets."""
