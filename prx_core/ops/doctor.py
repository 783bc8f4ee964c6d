"""`prx-corpus doctor`: is this environment able to build the corpus, and how fast?

Each check returns one line, OK / WARN / FAIL, so an operator sees at a glance whether the
fast image path (pillow-simd with AVX2, libjpeg-turbo), the codecs, Ray and storage are usable.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prx_core.store.storage import Storage

OK, WARN, FAIL = "OK", "WARN", "FAIL"
PINNED = (
    "dagster", "dagster-webserver", "dagster-k8s", "dagster-ray", "pylance", "lance-ray", "ray",
    "mosaicml-streaming", "torch", "torchvision", "transformers", "numpy", "pyarrow", "s3fs",
)
CODECS = {"JPEG": "jpg", "PNG (zlib)": "zlib", "WebP": "webp", "TIFF (libtiff)": "libtiff", "LittleCMS2": "littlecms2"}
PILLOW_SIMD_STAMP = ".prx-pillow"  # written by scripts/setup.sh into the venv


@dataclass(frozen=True)
class Check:
    status: str
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<22} {self.detail}"


def check_versions() -> list[Check]:
    checks = [Check(OK, "python", sys.version.split()[0])]
    for dist in PINNED:
        try:
            checks.append(Check(OK, dist, md.version(dist)))
        except md.PackageNotFoundError:
            checks.append(Check(FAIL, dist, "not installed (run: make setup)"))
    return checks


def _distribution_of_pil() -> str | None:
    for dist in ("pillow-simd", "pillow"):
        try:
            return f"{dist} {md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return None


def _cpu_has_avx2() -> bool:
    try:
        return "avx2" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def pillow_build_flags() -> str | None:
    """How PIL's C core was compiled: the GCC command line kept in its debug info
    (`GNU C17 ... -mavx2 ...`), else the flags scripts/setup.sh recorded in the venv."""
    from PIL import _imaging

    try:
        binary = Path(_imaging.__file__).read_bytes()
    except OSError:
        binary = b""
    start = binary.find(b"GNU C")
    if start >= 0:
        end = binary.find(b"\0", start)
        return binary[start:end].decode(errors="replace")
    stamp = Path(sys.prefix) / PILLOW_SIMD_STAMP
    return stamp.read_text().strip() if stamp.exists() else None


def check_pillow() -> list[Check]:
    from PIL import features

    dist = _distribution_of_pil()
    checks = []
    if dist and dist.startswith("pillow-simd"):
        checks.append(Check(OK, "pillow-simd", dist))
        flags = pillow_build_flags() or ""
        if "-mavx2" in flags and _cpu_has_avx2():
            checks.append(Check(OK, "AVX2", "PIL._imaging compiled with -mavx2; CPU supports avx2"))
        elif "-mavx2" in flags:
            checks.append(Check(FAIL, "AVX2", "built with -mavx2 but this CPU lacks avx2"))
        else:
            checks.append(Check(WARN, "AVX2", "pillow-simd was not compiled with -mavx2 (run: make setup)"))
    else:
        checks.append(Check(WARN, "pillow-simd", f"{dist or 'no PIL'} active: stock Pillow, resizes ~10x slower (run: make setup)"))
        checks.append(Check(WARN, "AVX2", "not in use (stock Pillow)"))
    turbo = features.check_feature("libjpeg_turbo")
    if turbo:
        checks.append(Check(OK, "libjpeg-turbo", f"libjpeg-turbo {features.version_feature('libjpeg_turbo') or '?'}"))
    else:
        checks.append(Check(WARN, "libjpeg-turbo", f"libjpeg {features.version('jpg') or '?'} is not libjpeg-turbo (decodes ~2x slower)"))
    for label, feature in CODECS.items():
        available = features.check(feature)
        status = OK if available else (FAIL if feature in ("jpg", "zlib") else WARN)
        checks.append(Check(status, f"codec {label}", (features.version(feature) or "available") if available else "missing"))
    return checks


def check_ray(timeout: float = 120.0) -> Check:
    """Start an embedded Ray in a child process (so a hang cannot block the doctor), the way a build
    starts one (prx_core.compute.quiet.start_ray: on loopback only)."""
    code = (
        "import ray, time; t = time.time();"
        "from prx_core.compute.quiet import start_ray;"
        "start_ray(num_cpus=1, log_to_driver=False);"
        "assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42;"
        "print(f'{time.time() - t:.1f}'); ray.shutdown()"
    )
    started = time.time()
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Check(FAIL, "ray start", f"embedded Ray did not start within {timeout:.0f} s")
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
        return Check(FAIL, "ray start", f"embedded Ray failed: {tail}")
    seconds = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else f"{time.time() - started:.1f}"
    return Check(OK, "ray start", f"embedded Ray started and ran a task in {seconds} s")


def check_vllm() -> Check:
    """vLLM here (the GPU image), else the vLLM test environment (`.venv-vllm`, what `make test`
    installs), imported by its own Python; WARN where neither is."""
    from prx_core.models.vllm_cpu import vllm_python, vllm_version

    if importlib.util.find_spec("vllm") is not None:
        return Check(OK, "vllm", md.version("vllm"))
    python = vllm_python()
    if python is None:
        return Check(WARN, "vllm", "not importable here (expected: it runs in the GPU worker image; "
                                   "make test installs a CPU one in .venv-vllm)")
    found = vllm_version(python)
    if isinstance(found, str):
        return Check(FAIL, "vllm", f"{python} cannot import vllm: {found} (run: make test, or scripts/setup-vllm.sh)")
    return Check(OK, "vllm", f"{found[0]} on {found[1]}, from {python} (the vLLM test environment)")


def check_storage(root: str) -> Check:
    ok, message = Storage(root).check_writable()
    return Check(OK if ok else FAIL, "storage root", message)


def run_doctor(root: str, with_ray: bool = True) -> list[Check]:
    checks = check_versions() + check_pillow()
    if with_ray:
        checks.append(check_ray())
    checks.append(check_vllm())
    checks.append(check_storage(root))
    return checks


def default_root() -> str:
    return os.environ.get("PRX_ROOT", os.path.join(os.getcwd(), ".prx", "corpus"))
