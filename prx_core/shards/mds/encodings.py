"""The MDS encoding of precomputed text latents, byte for byte the `bf16` encoding PRX registers.

Why our own: PRX's trainer decodes `latent_<caption key>_<preset>` columns with a custom
mosaicml-streaming encoding named `bf16`, so the shards must hold exactly its bytes: ndim as one
little-endian uint32, the shape as ndim little-endian int32, then the bfloat16 bit patterns as
uint16, C order. Registering the same bytes under the same name lets our writer produce them and
our loader read them without importing PRX; whichever registration comes first is kept, both
decode alike. Masks (`attention_mask_<caption key>_<preset>`) use streaming's stock ndarray
encoding.

Importing this module does not import mosaicml-streaming (torch, transformers: ~15 s): the Dagster
definitions read `latent_columns` here and must load without torch. `BFloat16Tensor`, whose base
class comes with streaming, is defined on first use (`register_encodings`, or importing the name).
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from typing import Any

import numpy as np

BF16 = "bf16"
MASK_ENCODING = "ndarray:uint8"  # dtype fixed, shape stored per sample (1-D, any length >= 1)
CAPTION_KEY = "caption"
LATENT_PREFIX = "latent_"
MASK_PREFIX = "attention_mask_"
_INT32_MAX = (1 << 31) - 1


def __getattr__(name: str) -> Any:
    if name == "BFloat16Tensor":
        return _bfloat16_tensor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _bfloat16_tensor_class() -> type:
    """The `bf16` Encoding class: built once, when streaming is wanted anyway."""
    from streaming.base.format.mds.encodings import Encoding

    class BFloat16Tensor(Encoding):
        """`bf16`: a bfloat16 tensor of any shape, as its raw bit patterns behind a shape header.

        `encode` takes a torch.bfloat16 tensor, or a numpy uint16 array of bfloat16 bit patterns
        (what a writer reads from Arrow/Lance storage, no torch conversion needed); `decode`
        returns a torch.bfloat16 tensor.
        """

        size = None  # variable

        def encode(self, obj: Any) -> bytes:
            return encode_bf16(obj)

        def decode(self, data: bytes) -> Any:
            return decode_bf16(data)

    BFloat16Tensor.__module__, BFloat16Tensor.__qualname__ = __name__, "BFloat16Tensor"  # picklable by name
    return BFloat16Tensor


def encode_bf16(obj: Any) -> bytes:
    """The `bf16` bytes of a torch.bfloat16 tensor or of a numpy uint16 array of its bit patterns."""
    bits = _bit_patterns(obj)
    if any(dim > _INT32_MAX for dim in bits.shape):
        raise ValueError(f"bf16: shape {bits.shape} does not fit int32 dimensions")
    header = struct.pack(f"<I{bits.ndim}i", bits.ndim, *bits.shape)
    return header + np.ascontiguousarray(bits, dtype="<u2").tobytes()


def decode_bf16(data: bytes) -> Any:
    """The torch.bfloat16 tensor of `bf16` bytes; ValueError when they do not match their header."""
    import torch

    shape, offset = _read_header(data)
    count = math.prod(shape)
    if len(data) != offset + 2 * count:
        raise ValueError(f"bf16: {len(data)} bytes, shape {shape} needs {offset + 2 * count}")
    # astype copies into native uint16: a tensor over the reader's immutable bytes could not be written
    bits = np.frombuffer(data, "<u2", count, offset).astype(np.uint16).reshape(shape)
    return torch.from_numpy(bits).view(torch.bfloat16)


def _bit_patterns(obj: Any) -> np.ndarray:
    """The uint16 bit patterns of a bfloat16 tensor or of a uint16 array; TypeError for anything else."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind != "u" or obj.dtype.itemsize != 2:
            raise TypeError(f"bf16: a numpy array must hold uint16 bfloat16 bit patterns, got dtype {obj.dtype}")
        return obj
    torch = sys.modules.get("torch")  # a tensor means torch is loaded: never import it to refuse a value
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.dtype != torch.bfloat16:
            raise TypeError(f"bf16: expected a torch.bfloat16 tensor, got a {obj.dtype} tensor")
        return obj.detach().cpu().contiguous().view(torch.uint16).numpy()
    raise TypeError(f"bf16: expected a torch.bfloat16 tensor or a numpy uint16 array, got {type(obj).__name__}")


def _read_header(data: bytes) -> tuple[tuple[int, ...], int]:
    """(shape, offset of the values) of a `bf16` encoding."""
    if len(data) < 4:
        raise ValueError(f"bf16: {len(data)} bytes, too short for a header")
    (ndim,) = struct.unpack_from("<I", data, 0)
    offset = 4 + 4 * ndim
    if len(data) < offset:
        raise ValueError(f"bf16: {len(data)} bytes, too short for a shape of {ndim} dimensions")
    shape = struct.unpack_from(f"<{ndim}i", data, 4)
    if any(dim < 0 for dim in shape):
        raise ValueError(f"bf16: negative dimension in shape {shape}")
    return shape, offset


def register_encodings() -> None:
    """Make `bf16` known to streaming's MDS writer and reader; idempotent. A class already
    registered under the name (PRX's own, if imported first) is kept: it decodes the same bytes."""
    from streaming.base.format.mds import encodings as mds_encodings

    mds_encodings._encodings.setdefault(BF16, _bfloat16_tensor_class())


def latent_key(caption_key: str, preset: str) -> str:
    """PRX's column of the text latents of `caption_key` under text-tower `preset`."""
    return f"{LATENT_PREFIX}{caption_key}_{preset}"


def mask_key(caption_key: str, preset: str) -> str:
    """PRX's column of the attention mask of those latents."""
    return f"{MASK_PREFIX}{caption_key}_{preset}"


def latent_columns(preset: str, masks: bool) -> dict[str, str]:
    """The extra MDS columns (name -> encoding) that carry the `caption` latents of `preset`."""
    columns = {latent_key(CAPTION_KEY, preset): BF16}
    if masks:
        columns[mask_key(CAPTION_KEY, preset)] = MASK_ENCODING
    return columns


def is_text_column(name: str, encoding: str) -> bool:
    """Whether an MDS column beyond the base ones is a text latent or mask column in its encoding."""
    return ((name.startswith(LATENT_PREFIX) and encoding == BF16)
            or (name.startswith(MASK_PREFIX) and encoding == MASK_ENCODING))


def convert_text_columns(sample: dict[str, Any]) -> dict[str, Any]:
    """`sample` with every mask a 1-D torch.bool tensor (PRX's loader takes one), its latents as
    decoded: torch.bfloat16 tensors from `bf16` (ours or PRX's), checked, never copied."""
    import torch

    for key, value in sample.items():
        if key.startswith(LATENT_PREFIX):
            if not isinstance(value, torch.Tensor) or value.dtype != torch.bfloat16:
                raise TypeError(f"column {key!r}: expected a torch.bfloat16 tensor, got {type(value).__name__}")
        elif key.startswith(MASK_PREFIX):
            mask = torch.as_tensor(np.array(value, dtype=np.bool_))  # a copy: the decoded array is read-only
            sample[key] = mask.squeeze(0) if mask.ndim == 2 and mask.shape[0] == 1 else mask
    return sample
