#!/usr/bin/env bash
# The Triton kernels on a CUDA GPU: correctness against the torch references (tests/gpu), then the kernel
# benchmarks. Needs torch, triton, transformers, pytest and opentelemetry-sdk; run from the repository root:
#     bash bench/gpu_kernels.sh [OUTPUT_DIR]
set -uo pipefail
out=${1:-.}
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
$py -m pytest -q -p no:cacheprovider tests/gpu --junitxml="$out/gpu-tests.xml" 2>&1 | tail -25
echo "tests: $(( $(date +%s) - start )) s"
for args in "--dtype bf16" "--dtype bf16 --batch 1 --context 4096" "--dtype bf16 --tree-nodes 8" "--dtype fp32" \
            "--dtype bf16 --context 4096 --block-n 64" "--dtype bf16 --context 4096 --window 512 --block-n 64"; do
    $py bench/bench_paged_attention.py $args
done
$py bench/bench_nvfp4.py --kernel-only
echo "total: $(( $(date +%s) - start )) s"
