"""The `prx-corpus` console script as an operator runs it: doctor and demo-sources."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import yaml
from PIL import features

from prx_core.ops.doctor import _cpu_has_avx2
from prx_core.models.vllm_cpu import vllm_python

CLI = str(Path(sys.executable).with_name("prx-corpus"))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=600, env=os.environ.copy())


def lines_by_name(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) >= 2 and parts[0] in ("OK", "WARN", "FAIL"):
            name = line[6:28].strip()
            out[name] = parts[0]
    return out


def test_setup_installed_pillow_simd_with_every_codec() -> None:
    """scripts/setup.sh must leave pillow-simd (not stock Pillow) with the codecs the corpus needs."""
    assert md.version("pillow-simd")
    try:
        md.version("pillow")
        raise AssertionError("stock Pillow is installed beside pillow-simd")
    except md.PackageNotFoundError:
        pass
    for codec in ("jpg", "zlib", "webp", "libtiff", "littlecms2", "freetype2"):
        assert features.check(codec), f"pillow-simd built without {codec}"
    assert features.check_feature("libjpeg_turbo")


def test_doctor_reports_every_check(tmp_path: Path) -> None:
    result = run("doctor", "--root", str(tmp_path / "corpus"))
    assert result.returncode == 0, result.stdout + result.stderr
    status = lines_by_name(result.stdout)
    for name in ("python", "dagster", "pylance", "ray", "ray start", "mosaicml-streaming", "torch", "storage root",
                 "libjpeg-turbo", "codec JPEG", "codec PNG (zlib)", "codec WebP", "codec TIFF (libtiff)",
                 "codec LittleCMS2"):
        assert status.get(name) == "OK", (name, result.stdout)
    assert status["pillow-simd"] == "OK"
    assert status["AVX2"] == ("OK" if _cpu_has_avx2() else "FAIL")
    # make test installs the vLLM test environment (scripts/setup-vllm.sh): doctor finds and imports it
    assert status["vllm"] == ("OK" if vllm_python() else "WARN"), result.stdout
    assert "embedded Ray started and ran a task" in result.stdout


def test_doctor_fails_on_unwritable_root() -> None:
    result = run("doctor", "--no-ray", "--root", "/proc/prx-corpus")
    assert result.returncode == 1
    assert lines_by_name(result.stdout)["storage root"] == "FAIL"


def test_demo_sources_command(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = run("demo-sources", str(out), "--no-wallpapers")
    assert result.returncode == 0, result.stderr
    assert "samples in" in result.stdout and "planted:" in result.stdout
    catalog = yaml.safe_load((out / "sources.yaml").read_text())
    assert [s["format"] for s in catalog["sources"]] == ["parquet", "imagefolder", "webdataset", "huggingface"]
    assert (out / "manifest.json").exists()


def test_unknown_command_is_a_usage_error() -> None:
    result = run("explode")
    assert result.returncode == 2 and "invalid choice" in result.stderr
