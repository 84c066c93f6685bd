# H200: quantization checks and kernel timings in one call: the GPU tests of the quantized paths,
# the GGUF-block matmul sweep (benchmarks/quant_gpu.py), the FP8 linear benchmark, and the fp8-KV
# decode attention beside FlashInfer. Carry .whl, .smol_tok and .fi (see flashinfer.sh).
source benchmarks/h200/setup.sh
source benchmarks/h200/flashinfer.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
T_TAIL=30 t "${TESTS_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider ${QUANT_TESTS:-tests/test_quant_kernels.py tests/test_fp8_linear_gpu.py tests/test_kv_fp8_gpu.py}
[ -n "${SKIP_SWEEP:-}" ] || T_TAIL=80 t 240 python3 benchmarks/quant_gpu.py --out "$OUT/quant_gpu_h200.json" ${SWEEP_ARGS:-}
[ -n "${SKIP_FP8:-}" ] || T_TAIL=40 t 150 python3 benchmarks/fp8_linear.py --out "$OUT/fp8_linear_h200.json"
[ -n "${KV_BENCH:-}" ] && T_TAIL=40 t 150 $KV_BENCH
ls -la "$OUT"
