# H200: the GPU overlap/cascade-graph tests and the cascade kernel at its adopted defaults.
source benchmarks/h200/setup.sh
mkdir -p /tmp/site && tar -xJf .fi/fi.tar.xz -C /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .fi/*.whl
export FLASHINFER_CUDA_ARCH_LIST=9.0a RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
t() { local lim=$1; shift; echo "=== $*"; timeout "$lim" "$@" 2>&1 | grep -v "it/s]" | tail -n 30; echo "=== rc=${PIPESTATUS[0]}"; }
t 70 python3 -m pytest -q -p no:cacheprovider tests/test_overlap_gpu.py
t 210 python3 benchmarks/kernels.py "$OUT" --only cascade
ls -la "$OUT"
