"""Pixels: safe decode, the PRX buckets, pHash, JPEG quality, and `process_image`."""
