"""Source datasets: the catalog, the format readers, and ingest into `samples` rows."""
