# H200: the one-row GGUF matmul configs swept beside the defaults (one row per one-warp int8x
# program, the large weights' default; more rows or K per thread), then batch-1 decode on the
# engine (bf16), Q4_0 on the default choice (int8x on the large weights, dp4a on the rest), on
# dp4a for every weight and on int8x for every weight, in one suite run; then the GPU kernel
# test. Carry .whl and .smol_tok.
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
ROWS="${ROWS:-int8x:1:1024:1,int8x:1:2048:2,int8x:2:2048:2,int8x:4:1024:4,int8x:4:4096:4,dp4a:4:1024:4,dp4a:4:2048:4}"
T_TAIL=60 t 240 python3 benchmarks/quant_gpu.py --ms 1 --kinds int8x,dp4a --configs "$ROWS" --out "$OUT/quant_gpu_rows.json"
SUITE_QUANT_VARIANTS=q4_0,q4_0_dp4a,q4_0_int8x T_TAIL=40 t 200 python3 benchmarks/suite.py --device cuda --workers engine,quant --engine-steps decode_b1 --out "$OUT/suite_q4_one_row.json"
T_TAIL=8 t 150 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py -k gpu
