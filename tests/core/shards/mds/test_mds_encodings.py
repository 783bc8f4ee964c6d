"""Text latents in MDS: the `bf16` encoding PRX's trainer decodes, byte for byte, and masks read
back by mosaicml-streaming itself from a real chunk written by `write_chunk`; verification accepting
exactly those extra columns, and `rewrite_chunk` keeping them bit for bit."""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from streaming import MDSWriter, StreamingDataset
from streaming.base.format.mds import encodings as mds_encodings
from streaming.base.format.mds.encodings import Encoding, mds_decode, mds_encode
from streaming.base.util import clean_stale_shared_memory

from prx_core.shards.mds.encodings import (
    BF16,
    MASK_ENCODING,
    BFloat16Tensor,
    convert_text_columns,
    latent_columns,
    latent_key,
    mask_key,
    register_encodings,
)
from prx_core.shards.mds.publish import publish_stream
from prx_core.shards.mds.read import decode_int, iter_raw_rows, open_jpeg, read_stream_rows, verify_shard, verify_stream
from prx_core.shards.mds.rewrite import rewrite_chunk
from prx_core.shards.mds.streams import HASHES, MDS_COLUMNS, SIZE_LIMIT, read_chunk_record, write_chunk
from prx_core.store.storage import Storage

PROMPT_TOKENS, HIDDEN = 256, 32


def bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint16).numpy()


@pytest.mark.parametrize("shape", [(0, 8), (5, 16), (256, 32), (1, 3, 4)])
def test_round_trip_is_bit_exact_and_numpy_bit_patterns_encode_alike(shape: tuple[int, ...]) -> None:
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(torch.bfloat16)
    encoded = BFloat16Tensor().encode(tensor)
    decoded = BFloat16Tensor().decode(encoded)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == tensor.shape
    assert np.array_equal(bits(decoded), bits(tensor))
    assert BFloat16Tensor().encode(bits(tensor)) == encoded
    assert BFloat16Tensor().encode(bits(tensor).astype(">u2")) == encoded  # stored little-endian whatever the input


def test_bytes_are_prx_layout_assembled_by_hand() -> None:
    # bfloat16 bit patterns: 1.0, -2.0, 0.5 / 0.0, 3.0, -0.375
    patterns = [0x3F80, 0xC000, 0x3F00, 0x0000, 0x4040, 0xBEC0]
    tensor = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -0.375]], dtype=torch.bfloat16)
    by_hand = struct.pack("<I", 2) + struct.pack("<2i", 2, 3) + np.array(patterns, "<u2").tobytes()
    assert BFloat16Tensor().encode(tensor) == by_hand
    assert torch.equal(BFloat16Tensor().decode(by_hand), tensor)
    # C order: a transposed view is stored as its own shape, row by row
    transposed = struct.pack("<I2i", 2, 3, 2) + np.array(patterns, "<u2").reshape(2, 3).T.tobytes()
    assert BFloat16Tensor().encode(tensor.T) == transposed


@pytest.mark.parametrize("value", [torch.zeros(2, 3), [1.0, 2.0], np.zeros(3, np.float32)],
                         ids=["float32-tensor", "list", "float32-array"])
def test_anything_but_bfloat16_is_refused(value: object) -> None:
    with pytest.raises(TypeError, match=r"float32|list"):
        BFloat16Tensor().encode(value)


def test_truncated_bytes_are_refused() -> None:
    encoded = BFloat16Tensor().encode(torch.ones(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        BFloat16Tensor().decode(encoded[:-2])


def test_register_is_idempotent_and_keeps_a_class_registered_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(mds_encodings._encodings, BF16, raising=False)  # restored after the test
    before = dict(mds_encodings._encodings)
    register_encodings()
    register_encodings()
    assert mds_encodings._encodings == {**before, BF16: BFloat16Tensor}
    tensor = torch.ones(2, 2, dtype=torch.bfloat16)
    assert torch.equal(mds_decode(BF16, mds_encode(BF16, tensor)), tensor)

    class TheirBF16(Encoding):  # PRX's, registered before ours
        def encode(self, obj: object) -> bytes:
            return b""

        def decode(self, data: bytes) -> object:
            return None

    monkeypatch.setitem(mds_encodings._encodings, BF16, TheirBF16)
    register_encodings()
    assert mds_encodings._encodings[BF16] is TheirBF16


def test_column_names_are_prx_keys() -> None:
    assert latent_key("caption", "tiny") == "latent_caption_tiny"
    assert mask_key("caption", "tiny") == "attention_mask_caption_tiny"
    assert latent_columns("tiny", masks=False) == {"latent_caption_tiny": BF16}
    assert latent_columns("tiny", masks=True) == {"latent_caption_tiny": BF16,
                                                  "attention_mask_caption_tiny": MASK_ENCODING}


def tiny_jpeg(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), seed * 40, np.uint8)).save(buffer, format="JPEG", quality=92)
    return buffer.getvalue()


def latent_rows(tokens: list[int]) -> list[dict]:
    """Rows with an unpadded latent (valid tokens x hidden) and a full-length mask; one latent as
    numpy bit patterns, as a writer reading them from storage passes it."""
    generator = torch.Generator().manual_seed(7)
    rows = []
    for i, n in enumerate(tokens):
        latent = torch.randn(n, HIDDEN, generator=generator).to(torch.bfloat16)
        mask = np.zeros(PROMPT_TOKENS, np.uint8)
        mask[:n] = 1
        rows.append({"jpeg": tiny_jpeg(i), "caption": f"caption {i}", "original_caption": f"orig {i}", "width": 8,
                     "height": 8, "original_width": 8, "original_height": 8, "sample_id": f"alpha/{i:04d}",
                     "source": "alpha", "latent_caption_tiny": bits(latent) if i == 1 else latent,
                     "attention_mask_caption_tiny": mask, "expected": latent})
    return rows


def test_chunk_with_latents_reads_back_through_streaming_as_prx_expects(tmp_path) -> None:
    rows = latent_rows([3, 17, 0, PROMPT_TOKENS])
    folder = tmp_path / "c-latents"
    summary = write_chunk(rows, str(folder), columns=MDS_COLUMNS | latent_columns("tiny", masks=True))
    assert summary.samples == len(rows)
    clean_stale_shared_memory()
    dataset = StreamingDataset(local=str(folder), batch_size=1, shuffle=False)
    samples = [dataset[i] for i in range(dataset.num_samples)]
    del dataset
    lkey, mkey = "latent_caption_tiny", "attention_mask_caption_tiny"
    for row, sample in zip(rows, samples, strict=True):
        assert sample["sample_id"] == row["sample_id"] and lkey in sample and mkey in sample
        latent, mask = sample[lkey], sample[mkey]
        assert latent.dtype == torch.bfloat16 and np.array_equal(bits(latent), bits(row["expected"]))
        assert mask.dtype == np.uint8 and np.array_equal(mask, row[mkey])
        # PRX's loader: a bool mask longer than the latent must count its tokens, then pads to it
        prx_mask = torch.tensor(mask, dtype=torch.bool)
        assert prx_mask.shape == (PROMPT_TOKENS,) and int(prx_mask.sum()) == latent.shape[0]
        padded = torch.cat([latent, latent.new_zeros(PROMPT_TOKENS - latent.shape[0], HIDDEN)])
        assert padded.shape == (PROMPT_TOKENS, HIDDEN)
        converted = convert_text_columns(dict(sample))  # what CorpusDataset returns
        assert converted[lkey] is latent
        assert converted[mkey].dtype == torch.bool and torch.equal(converted[mkey], prx_mask)


def test_masks_convert_to_one_dimensional_bool() -> None:
    sample = {"attention_mask_caption_tiny": np.array([[1, 1, 0]], np.uint8),
              "latent_caption_tiny": torch.zeros(2, 4, dtype=torch.bfloat16), "caption": "x"}
    converted = convert_text_columns(sample)
    assert converted["attention_mask_caption_tiny"].tolist() == [True, True, False]
    with pytest.raises(TypeError, match="latent_caption_tiny"):
        convert_text_columns({"latent_caption_tiny": np.zeros((2, 4), np.uint16)})


def test_columns_must_extend_mds_columns(tmp_path) -> None:
    with pytest.raises(ValueError, match="image"):
        write_chunk(latent_rows([1]), str(tmp_path / "c-x"), columns=latent_columns("tiny", masks=True))
    assert not (tmp_path / "c-x").exists()


def test_importing_the_column_names_loads_no_torch() -> None:
    """The Dagster definitions import `latent_columns`: they must load without streaming (torch)."""
    probe = ("import sys, prx_core.shards.mds.encodings as e; e.latent_columns('p', masks=True); "
             "print(sorted(m for m in ('torch', 'streaming') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("value", [0, 1, -1, 448, 2**31, -(2**63), 2**63 - 1])
def test_decode_int_is_streamings_int_decoder(value: int) -> None:
    stored = mds_encode("int", value)
    assert decode_int(stored) == mds_decode("int", stored) == value
    assert type(decode_int(stored)) is type(mds_decode("int", stored))


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_open_jpeg_is_streamings_jpeg_decoder(mode: str) -> None:
    buffer = io.BytesIO()
    Image.new(mode, (24, 16), (90, 40, 200, 10)[:len(mode)]).save(buffer, format="JPEG", quality=92)
    ours, theirs = open_jpeg(buffer.getvalue()), mds_decode("jpeg", buffer.getvalue())
    assert (ours.format, ours.mode, ours.size) == (theirs.format, theirs.mode, theirs.size) == ("JPEG", mode, (24, 16))
    assert ours.tobytes() == theirs.tobytes()


def test_the_sampled_read_back_loads_no_torch(tmp_path) -> None:
    """Each worker that checks a few samples of a published shard would otherwise import streaming,
    torch and transformers first (~5 s a process, most of an unchanged rebuild's CPU)."""
    probe = ("import io, sys, numpy as np; from PIL import Image; "
             "from prx_core.shards.mds.streams import BUCKET_FOLDER; "
             "from prx_core.shards.mds.sampled_read import check_image; "
             "b = io.BytesIO(); Image.new('RGB', (8, 8)).save(b, format='JPEG', quality=92); "
             "row = {'image': b.getvalue(), 'width': np.int64(8).tobytes(), 'height': np.int64(8).tobytes()}; "
             "print(check_image(row, BUCKET_FOLDER.fullmatch('8x8'), 92), "
             "sorted(m for m in ('torch', 'streaming', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "None []"


# Verification and rewrite of chunks that carry text latents: the readers must accept exactly
# MDS_COLUMNS plus text latent/mask columns in their encodings, and a rewrite must keep them.

LATENT, MASK = "latent_caption_tiny", "attention_mask_caption_tiny"
TEXT_COLUMNS = MDS_COLUMNS | latent_columns("tiny", masks=True)


def stream_folder(tmp_path) -> str:
    """A stream folder named as a bucket (8x8: `verify_shard` checks the images against it)."""
    folder = tmp_path / "mds" / "alpha" / "0" / "8x8"
    folder.mkdir(parents=True)
    return str(folder)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_verify_accepts_a_published_stream_with_latents_and_masks(tmp_path) -> None:
    rows = latent_rows([3, 17, 0, PROMPT_TOKENS])
    uri = stream_folder(tmp_path)
    write_chunk(rows[:2], os.path.join(uri, "c-a"), columns=TEXT_COLUMNS)
    write_chunk(rows[2:], os.path.join(uri, "c-b"), columns=TEXT_COLUMNS)
    assert publish_stream(uri, ["c-a", "c-b"]) == len(rows)
    index = json.loads(Path(uri, "index.json").read_text())
    assert all(dict(zip(s["column_names"], s["column_encodings"])) == TEXT_COLUMNS for s in index["shards"])

    report = verify_stream(uri, expected_sha256=[sha(r["jpeg"]) for r in rows])
    assert report.problems == [] and report.ok
    assert (report.count, report.hashes_ok, report.bytes_identical, report.decoded_ok) == (4, True, True, True)
    shard = verify_shard(uri, index["shards"][0], expected_sha256=[sha(r["jpeg"]) for r in rows[:2]])
    assert shard.problems == [] and shard.count == 2
    chunk = verify_stream(os.path.join(uri, "c-a"))  # a chunk folder is an MDS folder of its own
    assert chunk.ok and chunk.count == 2
    # masks alone, without latents, are text columns too
    write_chunk(latent_rows([5]), os.path.join(uri, "c-m"), columns=MDS_COLUMNS | {MASK: MASK_ENCODING})
    assert verify_stream(os.path.join(uri, "c-m")).ok

    read = read_stream_rows(uri, columns=["sample_id", LATENT, MASK])
    for row, back in zip(rows, read, strict=True):
        assert back["sample_id"] == row["sample_id"]
        assert back[LATENT].dtype == torch.bfloat16 and np.array_equal(bits(back[LATENT]), bits(row["expected"]))
        assert np.array_equal(back[MASK], row[MASK])


@pytest.mark.parametrize("extra", [{"foo": "str"}, {"latent_caption_x": "bytes"}, {"attention_mask_caption_x": "bytes"},
                                   {"attention_mask_caption_x": BF16}, {"latent_caption_x": MASK_ENCODING}],
                         ids=["unrelated", "latent-as-bytes", "mask-as-bytes", "mask-as-bf16", "latent-as-mask"])
def test_verify_reports_an_extra_column_that_is_no_text_latent(tmp_path, extra: dict[str, str]) -> None:
    (name, encoding), = extra.items()
    values = {"str": "bar", "bytes": b"\x01\x02", BF16: torch.ones(2, 3, dtype=torch.bfloat16),
              MASK_ENCODING: np.ones(4, np.uint8)}
    rows = [{**row, name: values[encoding]} for row in latent_rows([2, 4])]
    uri = stream_folder(tmp_path)
    write_chunk(rows, os.path.join(uri, "c-x"), columns=TEXT_COLUMNS | extra)
    publish_stream(uri, ["c-x"])
    report = verify_stream(uri, expected_sha256=[sha(r["jpeg"]) for r in rows])
    assert [p for p in report.problems if "column encodings differ" in p] == report.problems
    assert len(report.problems) == 1 and not report.ok
    assert report.hashes_ok and report.decoded_ok and report.bytes_identical  # only the columns are wrong
    shard = verify_shard(uri, json.loads(Path(uri, "index.json").read_text())["shards"][0])
    assert len(shard.problems) == 1 and "column encodings differ" in shard.problems[0]


def test_verify_reports_a_base_column_re_encoded_beside_latents(tmp_path) -> None:
    """`write_chunk` refuses this chunk itself: laid out by streaming's MDSWriter as `_write_local_chunk` does."""
    rows = latent_rows([2, 4])
    uri = stream_folder(tmp_path)
    columns = {**TEXT_COLUMNS, "caption": "bytes"}
    with MDSWriter(columns=columns, out=os.path.join(uri, "c-y"), hashes=list(HASHES), size_limit=SIZE_LIMIT,
                   max_workers=1) as writer:
        for row in rows:
            writer.write({**{c: row[c] for c in columns if c != "image"}, "caption": row["caption"].encode(),
                          "image": row["jpeg"]})
    publish_stream(uri, ["c-y"])
    report = verify_stream(uri, expected_sha256=[sha(r["jpeg"]) for r in rows])
    assert len(report.problems) == 1 and "column encodings differ" in report.problems[0]
    assert report.count == 2 and report.hashes_ok and report.bytes_identical


def test_rewrite_chunk_keeps_latents_and_masks_bit_for_bit(tmp_path) -> None:
    rows = latent_rows([3, 17, 0, PROMPT_TOKENS, 9])
    for i, row in enumerate(rows):
        row["content_id"], row["source_key"] = f"content-{i}", f"key-{i}"
    uri = stream_folder(tmp_path)
    refused = [{"sample_id": "alpha/refused", "content_id": "content-r", "source_key": "key-r",
                "reason": "no_caption", "message": "no caption"}]
    write_chunk(rows, os.path.join(uri, "c-old"), refused=refused, columns=TEXT_COLUMNS)
    storage = Storage(str(tmp_path))
    drop = 1

    new, kept = rewrite_chunk(storage, uri, "c-old", {drop})
    assert new is not None and new != "c-old" and kept == len(rows) - 1
    old_index = json.loads(Path(uri, "c-old", "index.json").read_text())
    new_index = json.loads(Path(uri, new, "index.json").read_text())
    for shard in new_index["shards"]:
        assert (shard["column_names"], shard["column_encodings"], shard["column_sizes"]) == (
            old_index["shards"][0]["column_names"], old_index["shards"][0]["column_encodings"],
            old_index["shards"][0]["column_sizes"])
    assert dict(zip(new_index["shards"][0]["column_names"], new_index["shards"][0]["column_encodings"])) == TEXT_COLUMNS
    expected = [row for i, row in enumerate(rows) if i != drop]
    record = read_chunk_record(os.path.join(uri, new))
    assert record["sample_id"].to_pylist() == [r["sample_id"] for r in expected] + ["alpha/refused"]
    assert record["content_id"].to_pylist() == [r["content_id"] for r in expected] + ["content-r"]

    # the stored latent and mask bytes are the original ones
    old_raw = {r["sample_id"]: r for r in read_raw(os.path.join(uri, "c-old"))}
    for raw in read_raw(os.path.join(uri, new)):
        assert raw[LATENT] == old_raw[raw["sample_id"]][LATENT] and raw[MASK] == old_raw[raw["sample_id"]][MASK]

    register_encodings()
    clean_stale_shared_memory()
    dataset = StreamingDataset(local=os.path.join(uri, new), batch_size=1, shuffle=False)
    samples = [dataset[i] for i in range(dataset.num_samples)]
    del dataset
    assert len(samples) == len(expected)
    for row, sample in zip(expected, samples, strict=True):
        assert sample["sample_id"] == row["sample_id"]
        assert sample[LATENT].dtype == torch.bfloat16 and sample[LATENT].shape == row["expected"].shape
        assert np.array_equal(bits(sample[LATENT]), bits(row["expected"]))
        assert sample[MASK].dtype == np.uint8 and np.array_equal(sample[MASK], row[MASK])

    assert verify_stream(os.path.join(uri, new), expected_sha256=[sha(r["jpeg"]) for r in expected]).ok
    publish_stream(uri, [new])
    assert verify_stream(uri, expected_sha256=[sha(r["jpeg"]) for r in expected]).ok
    assert rewrite_chunk(storage, uri, "c-old", {drop}) == (new, kept)  # a rerun reuses the complete chunk


def read_raw(folder: str) -> list[dict]:
    """A chunk's samples as raw column bytes, `sample_id` decoded."""
    index = json.loads(Path(folder, "index.json").read_text())
    return [{**raw, "sample_id": raw["sample_id"].decode()} for _, raw in iter_raw_rows(folder, index)]
