#!/usr/bin/env bash
# Idempotent set-up: Debian packages (when root), .venv, pinned dependencies, then
# pillow-simd built with AVX2 and every codec, installed last. Re-running is cheap: each
# step is skipped when its stamp matches what it would install.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
PILLOW_SIMD_VERSION="12.1.1.post0"
WITH_TEST="${PRX_SETUP_TEST:-1}"

# pip on these machines warns once per package about missing local mirror folders: hide that noise.
pip_q() { "$VENV/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
warn() { printf '\033[1;33m[setup] WARNING:\033[0m %s\n' "$*" >&2; }

# --- 1. Debian packages: codec headers for pillow-simd, demo wallpapers, Chromium for UI tests.
APT_PACKAGES=(
    libjpeg62-turbo-dev zlib1g-dev libpng-dev libwebp-dev libtiff-dev liblcms2-dev libfreetype6-dev
    gnome-backgrounds plasma-workspace-wallpapers libgs-common
)
# The explorer's browser test drives Debian's Chromium (Playwright never downloads a browser); the
# deployed-instance test starts a throwaway server of Debian's PostgreSQL (tests/e2e/postgres_server.py).
[ "$WITH_TEST" = 1 ] && APT_PACKAGES+=(chromium postgresql)
install_apt() {
    if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
        warn "not root or no apt-get: skipping Debian packages (${APT_PACKAGES[*]})"
        return
    fi
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        say "Debian packages present"
        return
    fi
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || warn "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || warn "apt-get install failed for some of: ${missing[*]} (the build falls back where it can)"
}

# --- 2. Virtualenv and pinned dependencies.
install_python() {
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating $VENV with $("$PY" --version)"
        "$PY" -m venv "$VENV"
    fi
    local extras="" lock="$ROOT/requirements-runtime.lock"
    [ "$WITH_TEST" = 1 ] && extras="[test]" && lock="$ROOT/requirements.lock"  # the test tools too
    local want
    want="$(cat "$lock" "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16)$extras"
    if [ -f "$VENV/.prx-deps" ] && [ "$(cat "$VENV/.prx-deps")" = "$want" ]; then
        say "Python dependencies up to date"
        return
    fi
    say "installing Python dependencies (first run: several minutes; torch is large)"
    # About 8.5 GB lands in the venv (4 GB of it torch's CUDA wheels, which PyPI's x86_64 torch and
    # torchvision need even on a CPU). Refuse early, in one line, rather than die mid-install.
    local free_gb need_gb=9
    free_gb=$(df -Pk "$ROOT" | awk 'NR==2 {print int($4 / 1048576)}')
    if [ "${free_gb:-0}" -lt "$need_gb" ]; then
        printf '\033[1;31m[setup] ERROR:\033[0m only %s GB free under %s; the Python install needs about %s GB: free disk space there (or clone onto a bigger disk) and rerun\n' \
            "${free_gb:-0}" "$ROOT" "$need_gb" >&2
        exit 1
    fi
    pip_q install -q --upgrade pip setuptools wheel
    local start=$SECONDS
    # The lock (make lock) is resolved ahead of time: pip's own resolver backtracks for many
    # minutes over s3fs/aiobotocore/botocore here. The project itself goes in without deps.
    # In two batches without pip's cache: the CUDA wheels first, so that the downloaded archives
    # of one batch and the unpacked other are never on disk together (peak ~ the venv's size).
    local heavy rest
    heavy="$(mktemp)"; rest="$(mktemp)"
    grep -E '^(nvidia-|cuda-|triton==|torch==|torchvision==)' "$lock" >"$heavy"
    grep -vE '^(nvidia-|cuda-|triton==|torch==|torchvision==)' "$lock" >"$rest"
    pip_q install -q --no-cache-dir --no-deps -r "$heavy"
    pip_q install -q --no-cache-dir --no-deps -r "$rest"  # complete by construction (make lock); see the Makefile
    rm -f "$heavy" "$rest"
    pip_q install -q --no-deps -e "$ROOT$extras"
    say "dependencies installed in $((SECONDS - start)) s"
    rm -f "$VENV/.prx-pillow"   # a fresh resolve may have put stock Pillow back
    echo "$want" >"$VENV/.prx-deps"
}

# --- 3. pillow-simd, last: any later pip install may pull stock Pillow back.
pillow_is_simd() {
    "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
try:
    md.version("pillow-simd")
except md.PackageNotFoundError:
    sys.exit(1)
try:
    md.version("pillow")
    sys.exit(1)   # both installed: the files of whichever came last win; reinstall cleanly
except md.PackageNotFoundError:
    pass
EOF
}
install_pillow_simd() {
    if [ -f "$VENV/.prx-pillow" ] && pillow_is_simd; then
        say "pillow-simd present ($(cat "$VENV/.prx-pillow"))"
        return
    fi
    local cflags="-mavx2"
    grep -qw avx2 /proc/cpuinfo 2>/dev/null || { warn "CPU lacks AVX2: building pillow-simd with SSE4 only"; cflags="-msse4"; }
    say "building pillow-simd $PILLOW_SIMD_VERSION from source (CC='cc $cflags')"
    pip_q uninstall -y -q pillow pillow-simd >/dev/null 2>&1 || true
    if CC="cc $cflags" pip_q install -q --no-cache-dir --no-binary pillow-simd \
        --force-reinstall --no-deps "pillow-simd==$PILLOW_SIMD_VERSION"; then
        echo "pillow-simd $PILLOW_SIMD_VERSION CC='cc $cflags'" >"$VENV/.prx-pillow"
        "$VENV/bin/python" - <<'EOF' || warn "pillow-simd was built without some codecs: run prx-corpus doctor"
from PIL import features
missing = [c for c in ("jpg", "zlib", "webp", "libtiff", "littlecms2") if not features.check(c)]
if missing:
    print("[setup] pillow-simd lacks:", ", ".join(missing))
    raise SystemExit(1)
EOF
    else
        warn "pillow-simd could not be built here; FALLING BACK to stock Pillow (resizes ~10x slower)"
        pip_q install -q "pillow>=11"
        echo "stock-pillow-fallback" >"$VENV/.prx-pillow"
    fi
}

install_apt
install_python
install_pillow_simd
say "ready: $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
