"""The MDS writer of the corpus, apart from `prx_core.shards.mds` because importing
mosaicml-streaming imports torch and transformers (~15 s): only the workers that write shards pay it,
not every process that loads the Dagster definitions or plans a stage."""

from __future__ import annotations

from typing import Any

import numpy as np
from streaming import MDSWriter
from streaming.base.format.mds.encodings import mds_encode

from prx_core.shards.encodings import register_encodings

register_encodings()  # `bf16` text-latent columns: MDSWriter refuses an encoding it does not know


class BytesJpegMDSWriter(MDSWriter):
    """An MDSWriter whose `jpeg` columns take already-encoded JPEG bytes and store them verbatim.

    Why: streaming's `jpeg` encoder passes bytes through only for a `JpegImageFile` opened from a
    named file; any other PIL image (one decoded from bytes included) is re-saved at Pillow's
    default quality 75, silently replacing the pipeline's q92 encode. The stock `jpeg` decoder is
    `Image.open(BytesIO(data))`, so verbatim bytes are exactly what readers expect and index.json
    still says `jpeg`. Mirrors `MDSWriter.encode_sample` of streaming 0.13; PIL values still go
    through the stock encoder.
    """

    def encode_sample(self, sample: dict[str, Any]) -> bytes:
        sizes: list[int] = []
        data: list[bytes] = []
        for key, encoding, size in zip(self.column_names, self.column_encodings, self.column_sizes):
            value = sample[key]
            if encoding == "jpeg" and isinstance(value, (bytes, bytearray, memoryview)):
                datum = bytes(value)
                if not datum.startswith(b"\xff\xd8\xff"):
                    raise ValueError(f"column {key!r}: bytes are not a JPEG (no SOI marker)")
            else:
                datum = mds_encode(encoding, value)
            if size is None:
                sizes.append(len(datum))
            elif size != len(datum):
                raise KeyError(f"column {key!r}: {len(datum)} bytes, encoding {encoding} needs {size}")
            data.append(datum)
        return np.array(sizes, np.uint32).tobytes() + b"".join(data)
