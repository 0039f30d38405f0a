#!/usr/bin/env bash
# The one script to run on a machine with an NVIDIA GPU. It needs no network and no venv: it uses
# the python3 that holds torch and triton there (set PYTHON to choose another).
#  1. the kernel and transfer tests compiled (Triton interpreter off): pytest -m gpu (and the
#     vLLM connector's CUDA-layout copies, tests/integrations/vllm_parts);
#  2. the CPU-side suites that exercise the same kernels, run against CUDA-built torch;
#  3. host<->device GB/s per layout and io backend next to one large pinned cudaMemcpy of the
#     same size (benchmarks/bench_transfer.py --device cuda).
# Runs in a few minutes on an H200. Usage: bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET TIERED_KV_DEVICE TIERED_KV_KERNEL_BACKEND
nvidia-smi -L || true
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
"$PY" -m pytest -p no:cacheprovider -q -m gpu tests/gpu 2>&1 | tee "$OUT_DIR/pytest_gpu.log" || status=1
# the vLLM connector's block <-> host copies on CUDA tensors in vLLM's layouts (no vLLM needed)
"$PY" -m pytest -p no:cacheprovider -q -m gpu tests/integrations/vllm_parts 2>&1 \
    | tee "$OUT_DIR/pytest_gpu_vllm_parts.log" || status=1
"$PY" benchmarks/bench_transfer.py --device cuda --kernel-backends triton \
    --json "$OUT_DIR/bench_transfer_cuda.json" 2>&1 | tee "$OUT_DIR/bench_transfer_cuda.log" || status=1
"$PY" benchmarks/bench_tiered.py --device cuda \
    --json "$OUT_DIR/bench_tiered_cuda.json" 2>&1 | tee "$OUT_DIR/bench_tiered_cuda.log" || status=1
exit $status
