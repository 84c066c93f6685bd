# H200: GPU correctness tests (kernels incl. cascade and GEMV, fused rope+store, whole-path HF
# parity, overlap, the 8B shape), the decode-GEMV sweep, and the cascade benchmark with its sweep.
source benchmarks/h200/setup.sh
source benchmarks/h200/flashinfer.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok   # tokenizer only: the random shapes need no weights
T_TAIL=60
t 170 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernel_rope_store.py tests/test_kernel_gemv.py \
  tests/test_hf_parity_gpu.py tests/test_overlap_gpu.py tests/test_engine_gpu.py::test_llama_8b_shape_random_weights_generates
t 150 python3 benchmarks/gemv.py --out "$OUT/gemv_h200.json"
t 230 python3 benchmarks/kernels.py "$OUT" --only cascade --sweep
ls -la "$OUT"
