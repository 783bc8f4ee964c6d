"""`prx-corpus opt-out`: samples opted out at scale, and takedowns that delete them for good.

- `apply`: an opt-out file applied: `opt_out` skip-list entries of the streams that hold its ids,
  or for a takedown the rows deleted and the streams republished without them, with an audit;
- `ids`: the file of ids (possibly millions) spooled by source and hash, matched a bucket at a time;
- `takedowns`: what a takedown named, recorded so no re-ingest brings it back (ingest refuses it);
- `purge`: `--purge`: every copy of what a takedown deleted removed from under the root now.
"""
