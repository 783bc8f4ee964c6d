"""prx_core."""
