"""The corpus explorer (`prx-corpus browse`): read-only web pages over the pipeline's Lance tables.

Imports `prx_core`, never dagster: it runs beside a corpus on any machine that can read it.
"""
