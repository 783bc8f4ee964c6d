"""`MDSShardWriter` writes what streaming's `MDSWriter` writes, byte for byte: shard files and
index.json, over several shards, with the text-latent columns the writer hands to streaming."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from streaming import MDSWriter, StreamingDataset

from prx_core.shards.mds.encodings import latent_columns, register_encodings
from prx_core.shards.mds.streams import HASHES, MDS_COLUMNS
from prx_core.shards.mds.writer import MDSShardWriter


def jpeg(seed: int, size: tuple[int, int] = (24, 16)) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=92)
    return buffer.getvalue()


def sample(i: int, latents: bool = False) -> dict:
    row = {"image": jpeg(i), "caption": f"a caption {i} \u00e9\u4e2d", "original_caption": "" if i % 3 else "orig",
           "width": 24, "height": 16, "original_width": 1000 + i, "original_height": -1 if i == 2 else 700,
           "sample_id": f"s{i:04d}", "source": "src"}
    if latents:
        tokens = 1 + i % 4
        row["latent_caption_tiny"] = torch.arange(tokens * 3, dtype=torch.float32).reshape(tokens, 3).to(torch.bfloat16)
        row["attention_mask_caption_tiny"] = np.ones(tokens, np.uint8)
    return row


def write_both(tmp_path: Path, columns: dict[str, str], samples: list[dict], size_limit: int) -> tuple[Path, Path]:
    register_encodings()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    writer = MDSShardWriter(columns, str(ours), HASHES, size_limit)
    for s in samples:
        writer.write(s)
    writer.finish()
    with MDSWriter(columns=columns, out=str(theirs), hashes=HASHES, size_limit=size_limit, max_workers=1) as stock:
        for s in samples:
            stock.write(s)
    return ours, theirs


@pytest.mark.parametrize("latents", [False, True], ids=["stock-columns", "with-text-latents"])
@pytest.mark.parametrize("size_limit", [1 << 27, 6_000], ids=["one-shard", "many-shards"])
def test_files_are_byte_identical_to_streamings_writer(tmp_path: Path, latents: bool, size_limit: int) -> None:
    columns = dict(MDS_COLUMNS) | (latent_columns("tiny", masks=True) if latents else {})
    samples = [sample(i, latents) for i in range(40)]
    ours, theirs = write_both(tmp_path, columns, samples, size_limit)
    names = sorted(p.name for p in theirs.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names
    assert (len(names) > 3) == (size_limit < 10_000)
    for name in names:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    dataset = StreamingDataset(local=str(ours), batch_size=1, shuffle=False)
    assert [dataset[i]["sample_id"] for i in range(len(samples))] == [s["sample_id"] for s in samples]
    assert dataset[2]["original_height"] == -1 and dataset[5]["caption"] == samples[5]["caption"]


def test_jpeg_columns_refuse_what_is_not_jpeg_bytes(tmp_path: Path) -> None:
    writer = MDSShardWriter(MDS_COLUMNS, str(tmp_path), HASHES, 1 << 27)
    with pytest.raises(ValueError, match="no SOI marker"):
        writer.write(sample(0) | {"image": b"\x89PNG\r\n"})
    with pytest.raises(TypeError):
        writer.write(sample(0) | {"image": Image.new("RGB", (4, 4))})
    with pytest.raises(AttributeError, match="`int` takes an int"):
        writer.write(sample(0) | {"width": 24.0})


def test_writing_stock_columns_loads_no_torch(tmp_path: Path) -> None:
    """Each worker that writes a chunk would otherwise import streaming, torch and transformers (~5 s)."""
    probe = ("import io, sys; from PIL import Image; from prx_core.shards.mds.streams import write_chunk; "
             "b = io.BytesIO(); Image.new('RGB', (24, 16)).save(b, format='JPEG'); "
             "write_chunk([{'jpeg': b.getvalue(), 'caption': 'c', 'original_caption': '', 'width': 24, 'height': 16, "
             "'original_width': 24, 'original_height': 16, 'sample_id': 's', 'source': 'x'}], sys.argv[1]); "
             "print(sorted(m for m in ('torch', 'streaming', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "chunk")], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
    assert (tmp_path / "chunk" / "index.json").is_file()
