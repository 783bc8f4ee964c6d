"""Source datasets: the catalog, the format readers (image folders in `folders/`), images fetched
by URL (`fetch/`), and ingest into `samples` rows."""
