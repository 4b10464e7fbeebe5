#!/usr/bin/env bash
# The checks that need a GPU, in one short script for a lent CUDA machine (CI has none).
#
# Run from the repository root where python3 has torch (CUDA), triton, transformers, pytest,
# pytest-timeout, hypothesis and sortedcontainers: `bash bench/gpu_check.sh [OUTDIR]`.
# 1. the Triton kernel tests and the Triton backend inside the model, on the GPU (not the
#    interpreter: tests/conftest.py sets TRITON_INTERPRET only without CUDA);
# 2. the batch-64 decode step with bf16 / int8 / fp8 KV pages (bench.bench_gpu_step);
# 3. the decode kernel's bandwidth, bf16 and quantized pages (bench.bench_kernels);
# 4. the engine tests on the tiny model, which run on CUDA where there is one.
# Each part has its own time limit; logs go to OUTDIR (default $OUT, else /tmp/gpu_check).
set -u
export PYTHONUNBUFFERED=1
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
# an installed radixkv maps kernels/ and server/ under radixkv; a bare checkout gets links
[ -e radixkv/kernels ] || ln -s ../kernels radixkv/kernels
[ -e radixkv/server ] || ln -s ../server radixkv/server
pytest=(python3 -m pytest -q -p no:cacheprovider --timeout 120 -m "not real_model" -rfE)

echo "== 1. Triton kernels and backend on the GPU"
timeout 300 "${pytest[@]}" tests/test_kernels.py tests/test_kernels_quant.py \
    tests/test_model.py::test_triton_backend_same_greedy_tokens_as_torch \
    tests/test_model.py::test_triton_backend_over_quantized_pages_runs_the_model \
    >"$out/pytest_kernels.log" 2>&1
echo "exit $?"; tail -25 "$out/pytest_kernels.log"

echo "== 2. batch-64 decode step, bf16 / int8 / fp8 KV pages"
timeout 100 python3 -m bench.bench_gpu_step --runs 2 2>&1 | tee "$out/bench_gpu_step.log"

echo "== 3. decode kernel bandwidth"
timeout 70 python3 -m bench.bench_kernels --iters 20 2>&1 | tee "$out/bench_kernels.log"

echo "== 4. engine tests (tiny model) on CUDA"
timeout 110 "${pytest[@]}" tests/test_engine.py tests/test_scheduler_policy.py tests/test_beam_search.py \
    >"$out/pytest_engine.log" 2>&1
echo "exit $?"; tail -25 "$out/pytest_engine.log"
