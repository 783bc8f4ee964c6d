"""`python -m benchmarks <command>`: `prx-bench` without the installed script."""

from benchmarks.cli import run

run()
