"""prx_resources."""
