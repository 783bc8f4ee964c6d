"""Pixels as JPEG bytes, for core tests that feed real photos (scikit-image's) to the pipeline."""

from __future__ import annotations

import io

import numpy as np


def jpeg(array: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()
