"""`python -m prx_cli`: the `prx-corpus` console script without the installed script."""

from prx_cli.main import run

run()
