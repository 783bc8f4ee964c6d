"""A `caption_column` that no file of the source has is a preflight problem for every format
(issue 43): tables were checked against their schema; here the image folder's metadata files
(metadata.jsonl, metadata.csv) and the WebDataset's members (an extension, a JSON field). Before,
`caption_column: descr` on a folder whose metadata.jsonl says `text` ingested every image without
a caption and failed the build in `captions`, 41 s later, suggesting a VLM configuration."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import yaml

from prx_cli.main import main
from prx_core.sources.catalog import parse_catalog
from prx_core.sources.preflight import check_source

JPEG = bytes.fromhex("ffd8ffe000104a46494600") + b"\0" * 32


def spec(base: Path, **entry):
    return parse_catalog({"sources": [{"name": "src", **entry}]}, base_dir=base).sources[0]


def problems(base: Path, **entry) -> list[tuple[str, str, str]]:
    return [(p.field, p.problem, p.fix) for p in check_source(spec(base, **entry), None)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("captions")
    for name in ("jsonl", "csv", "sidecars"):
        (base / name / "cats").mkdir(parents=True)
        for i in range(3):
            (base / name / "cats" / f"{i}.jpg").write_bytes(JPEG)
    (base / "jsonl" / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": f"cats/{i}.jpg", "text": f"cat {i}", "license": "cc0"}) + "\n" for i in range(3)))
    (base / "csv" / "metadata.csv").write_text("file_name,caption\n" + "".join(f"cats/{i}.jpg,cat {i}\n" for i in range(3)))
    for i in range(3):
        (base / "sidecars" / "cats" / f"{i}.txt").write_text(f"cat {i}")
    return base


def test_an_image_folders_caption_column_is_checked_against_its_metadata_files(folders: Path) -> None:
    ((field, problem, fix),) = problems(folders, format="imagefolder", uri="jsonl", caption_column="descr")
    assert field == "caption_column"
    assert problem == (f"column 'descr' is in no metadata file of the source ({folders}/jsonl/metadata.jsonl: "
                       "file_name, text, license)")
    assert fix == "set caption_column to one of license, text"
    assert problems(folders, format="imagefolder", uri="jsonl", caption_column="text") == []
    assert problems(folders, format="imagefolder", uri="jsonl") == []  # the default: not checked
    assert problems(folders, format="imagefolder", uri="csv", caption_column="caption") == []
    ((_, problem, fix),) = problems(folders, format="imagefolder", uri="csv", caption_column="text")
    assert "metadata.csv: file_name, caption)" in problem and fix == "set caption_column to one of caption"
    ((_, problem, fix),) = problems(folders, format="imagefolder", uri="sidecars", caption_column="text")
    assert problem.endswith("/sidecars holds none") and fix.startswith("remove caption_column")
    assert problems(folders, format="imagefolder", uri="sidecars") == []


def shard(path: Path, members: dict[str, bytes], gz: bool = False) -> None:
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_webdatasets_caption_column_is_checked_against_its_first_members(tmp_path: Path) -> None:
    (tmp_path / "txt").mkdir()
    shard(tmp_path / "txt" / "00000.tar", {"k0.jpg": JPEG, "k0.txt": b"a cat", "k1.jpg": JPEG, "k1.txt": b"a dog"})
    assert problems(tmp_path, format="webdataset", uri="txt", caption_column="txt") == []
    ((field, problem, fix),) = problems(tmp_path, format="webdataset", uri="txt", caption_column="caption")
    assert field == "caption_column" and fix == "set caption_column to txt"
    assert problem == f"caption_column 'caption': no .caption member in the first samples of {tmp_path}/txt/00000.tar " \
                      "(members: jpg, txt)"

    (tmp_path / "json").mkdir()
    meta = json.dumps({"caption": "a cat", "url": "https://example.org/a.jpg"}).encode()
    shard(tmp_path / "json" / "00000.tar.gz", {"k0.jpg": JPEG, "k0.json": meta}, gz=True)
    assert problems(tmp_path, format="webdataset", uri="json", caption_column="json.caption") == []
    ((_, problem, fix),) = problems(tmp_path, format="webdataset", uri="json", caption_column="json.text")
    assert "no .json member with that field in the first samples of" in problem and ".json fields: caption, url)" in problem
    assert fix == "set caption_column to json.caption or json.url"
    assert problems(tmp_path, format="webdataset", uri="json") == []  # the default rule: not checked


def test_build_stops_on_it_before_ray_starts(folders: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    catalog = tmp_path / "sources.yaml"
    catalog.write_text(yaml.safe_dump({"sources": [{"name": "folder", "format": "imagefolder",
                                                     "uri": str(folders / "jsonl"), "caption_column": "descr"}]}))
    assert main(["build", "--sources", str(catalog), "--root", str(tmp_path / "corpus")]) == 2
    err = capsys.readouterr().err
    assert "source 'folder': field 'caption_column': column 'descr' is in no metadata file" in err
    assert "fix: set caption_column to one of license, text" in err and not (tmp_path / "corpus").exists()
