# H200: GPU tests of the whole CUDA path (now with the decode GEMV), benchmarks/kernels.py with the
# adopted defaults (ours vs FlashInfer 0.7.4 vs roofline, JSON + PNG), and the fork-heavy program
# workload with cascade on vs off (llama-3.1-8b shape, random bf16 weights).
source benchmarks/h200/setup.sh
source benchmarks/h200/flashinfer.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok   # tokenizer only: the random shapes need no weights
R=benchmarks/results
T_TAIL=50
t 150 python3 -m pytest -q -p no:cacheprovider tests/test_hf_parity_gpu.py tests/test_overlap_gpu.py tests/test_kernel_gemv.py \
  tests/test_kernels_gpu.py -k "not decode and not extend"
t 260 python3 benchmarks/kernels.py "$OUT"
t 150 python3 benchmarks/forks.py --model-shape llama-3.1-8b --device cuda --out $OUT/forks_h200.json
ls -la "$OUT"
