"""The `captions` stage: every eligible content of a source captioned once per captioner version.

- `stage`: the declaration (`CAPTIONS`), its settings and steps, on captioner actors or one vLLM pipeline;
- `units`: the work of a unit: pending captions found, inputs read, captions checked and written;
- `quality`: the caption checks' part of it (which stored captions still need a verdict, the counts);
- `report`: what a run reports (`CaptionsReport`).
"""
