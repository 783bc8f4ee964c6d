"""Images fetched by URL: a metadata-only source's ingest unit fetches its own rows' images.

- `download`: what a unit fetches (a URL table's rows, an HF `Image()` column of paths) and how a
  file, an object-store key or a URL is read;
- `window`: a sliding window of fetches over a reader's batches, so a slow host cannot sink a unit;
- `client`: http(s) fetches (aiohttp): per-host bounds, timeouts, retries, redirects, the size cap;
- `policy`: what a source's fetches may reach (public hosts and its own objects, unless the catalog says more);
- `robots`: the opt-outs a server states for one image (`X-Robots-Tag`).
"""
