"""The corpus root: URIs, table schemas, Lance I/O, partitions, compaction and upkeep."""
