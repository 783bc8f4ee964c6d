"""Image folders (`format: imagefolder`): image files with their captions and metadata beside them.

- `reader`: a folder read as one fragment: its images, sidecar `<stem>.txt` captions, bounded reads;
- `walk`: a tree of 100M files walked in parallel batches without holding its listing;
- `metadata`: Hugging Face `imagefolder` metadata files (`metadata.jsonl`, `metadata.csv`), keyed by file name;
- `captions`: what an image carries besides its bytes, and which of sidecar and metadata wins.
"""
