#!/usr/bin/env bash
# The NVFP4 W4A16 kernels on a CUDA GPU, in one pass: the compiled kernels against the dequantised products
# (tests/gpu -k nvfp4), the sweep of few-row configurations, the kernel benchmark against bf16 matmuls, and
# decode through the engine with bf16 then NVFP4 weights. Needs torch, triton, transformers, pytest, gguf and
# opentelemetry-sdk; run from the repository root:
#     bash bench/gpu_nvfp4.sh [OUTPUT_DIR]
set -uo pipefail
out=${1:-.}
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONPATH="${PYTHONPATH:-}:$PWD"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
stage() { echo "== $1: $(( $(date +%s) - start )) s"; }
timeout 150 $py -m pytest -q -p no:cacheprovider tests/gpu -k nvfp4 > "$out/gpu-tests.txt" 2>&1
tail -4 "$out/gpu-tests.txt"; stage tests
timeout 200 $py bench/sweep_nvfp4_tiles.py --rows few --quick > "$out/sweep.txt" 2>&1
grep -v "^  " "$out/sweep.txt"; grep -c "^  " "$out/sweep.txt"; stage sweep
timeout 90 $py bench/bench_nvfp4.py --kernel-only 2>&1 | tee "$out/kernels.txt" | tail -14; stage kernels
timeout 150 $py bench/bench_gpu_decode.py 2>&1 | tee "$out/decode.txt" | tail -10; stage decode
