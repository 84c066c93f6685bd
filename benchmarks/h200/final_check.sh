# H200: the GPU overlap/cascade-graph tests and the cascade kernel at its adopted defaults.
source benchmarks/h200/setup.sh
source benchmarks/h200/flashinfer.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
T_TAIL=30
t 70 python3 -m pytest -q -p no:cacheprovider tests/test_overlap_gpu.py
t 210 python3 benchmarks/kernels.py "$OUT" --only cascade
ls -la "$OUT"
