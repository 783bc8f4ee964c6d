"""`prx-corpus plan` is as careful as `build` (issue 43): the same preflight (one line per problem,
exit 2, nothing sampled) and, per source, the dominant reject reasons with an example and the
likely fix, printed and in `--json`. The sources are what a new user writes: a Hugging Face
dataset with a wrong `caption_column`, and one saved from a path-based `Image()` column (only the
paths are stored, the images lie outside the source's folder)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from prx_cli.main import main

ROWS = 12
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def jpeg(i: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (640, 480), (i * 20, 80, 40)).save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("plan-preflight")
    (base / "images").mkdir()
    paths = []
    for i in range(ROWS):
        (base / "images" / f"{i}.jpg").write_bytes(jpeg(i))
        paths.append(str(base / "images" / f"{i}.jpg"))
    captions = [f"a flat colour {i}" for i in range(ROWS)]
    for name, images in (("embedded", [{"bytes": jpeg(i), "path": None} for i in range(ROWS)]),
                         ("paths", [{"bytes": None, "path": p} for p in paths])):  # Dataset.to_parquet of paths
        (base / name / "data").mkdir(parents=True)
        pq.write_table(pa.table({"image": pa.array(images, IMAGE), "text": captions}),
                       base / name / "data" / "train-00000-of-00001.parquet")
    entries = [{"name": "wrong_caption", "format": "huggingface", "uri": "embedded", "caption_column": "descr"},
               {"name": "image_paths", "format": "huggingface", "uri": "paths"},
               {"name": "good", "format": "huggingface", "uri": "embedded", "caption_column": "text"}]
    (base / "sources.yaml").write_text(yaml.safe_dump({"sources": entries}))
    return base / "sources.yaml"


def test_plan_runs_builds_preflight(catalog: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--sources", str(catalog), "--sample", "20"]) == 2
    out = capsys.readouterr()
    (problem, summary) = out.err.strip().splitlines()
    assert problem.startswith(f"prx-corpus: error: {catalog}: source 'wrong_caption': field 'caption_column': "
                              "column 'descr' is not in ")
    assert "(its columns: image, text); fix: set caption_column to one of its columns" in problem
    assert "1 problem(s) found before sampling: nothing was planned" in summary
    assert "sampling" not in out.out and "Traceback" not in out.err


def test_plan_names_the_dominant_reject_reason_its_example_and_fix(catalog: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--sources", str(catalog), "--source", "image_paths", "--source", "good",
                 "--sample", "20", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    (line,) = [x for x in printed.splitlines() if x.startswith("image_paths: rejects ")]
    assert line.startswith(f"image_paths: rejects path_outside_source {ROWS} of {ROWS} sampled (~{ROWS} rows), "
                           "e.g. data/train-00000-of-00001:0: \"image path ")
    assert "fix: the Image() paths point outside the source's uri: embed the images' bytes in the table" in line
    assert not any(x.startswith("good: rejects") for x in printed.splitlines())
    assert "sizing for this machine (" in printed and "wall time on this machine (" in printed  # not 64 cores, 8 GPUs
    plans = {p["source"]: p for p in json.loads(out.read_text())["sources"]}
    (reason,) = plans["image_paths"]["rejects"]
    assert (reason["reason"], reason["sampled"], reason["rows"]) == ("path_outside_source", ROWS, ROWS)
    assert reason["example"]["key"] == "data/train-00000-of-00001:0" and "resolves outside the source root" in reason["example"]["message"]
    assert plans["good"]["rejects"] == [] and plans["good"]["mds_samples"] == ROWS


def test_without_preflight_a_reader_error_is_a_reject_not_a_traceback(catalog: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--sources", str(catalog), "--source", "wrong_caption", "--sample", "20",
                 "--no-preflight"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("wrong_caption: rejects ")]
    assert "unreadable_fragment" in line and "has no column(s) ['descr']" in line
    assert "fix: the files cannot be read as `format: huggingface`" in line


def test_plan_prices_a_backfill(catalog: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--sources", str(catalog), "--source", "good", "--sample", "20", "--cpus", "16", "--gpus", "1",
                 "--gpu-hour-price", "2.5", "--cpu-hour-price", "0.05", "--gb-month-price", "0.023",
                 "--currency", "EUR "]) == 0
    printed = capsys.readouterr().out
    assert "wall time on given (--cpus, --gpus): 16 cores, 1 GPUs: " in printed
    (cost,) = [x for x in printed.splitlines() if x.startswith("cost at ")]
    assert cost.startswith("cost at EUR 2.5/GPU-hour, EUR 0.05/core-hour, EUR 0.023/GB-month: EUR ") and "a month to keep" in cost
    assert main(["plan", "--sources", str(catalog), "--gpu-hour-price", "-1"]) == 2
    assert "--gpu-hour-price: must not be negative" in capsys.readouterr().err
