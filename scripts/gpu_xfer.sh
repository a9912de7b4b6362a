#!/usr/bin/env bash
# Branch h-xfer (issue 23: kvcore.transfer reorganised, no behaviour change) on one CUDA GPU, ~3 min.
# Runs scripts/gpu_transfer.sh with a short deadline: its setup (NIXL from .whl/, versions), the GPU
# transfer tests (NIXL VRAM between two processes, the host tier's staged copies on two streams, the
# bench's VRAM rows), then as many NIXL VRAM rows as the deadline leaves. Pass: the "tests" step
# exits 0 and SUMMARY.txt's rows say "exact yes". Everything goes to $OUT (default
# /tmp/kvcore-gpu-xfer); $OUT/SUMMARY.txt is the short version.
#   bash scripts/gpu_xfer.sh
set -uo pipefail
export OUT=${OUT:-/tmp/kvcore-gpu-xfer}
DEADLINE=${DEADLINE:-170} bash "$(dirname "$0")/gpu_transfer.sh"
echo "== h-xfer: full logs in $OUT (tests.log: the GPU transfer tests)"
