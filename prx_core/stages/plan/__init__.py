"""`prx-corpus plan`: what building a source will cost, measured on a sample before a backfill.

- `sample`: a sample of a source's images put through what the stages will do to them, timed,
  and the source's size from its metadata;
- `estimates`: the arithmetic that scales both into rows, streams, bytes, hours and prices;
- `machine`: what the wall time is sized for (this machine, a Ray cluster, given cores and GPUs)
  and what a backfill is priced at.
"""
