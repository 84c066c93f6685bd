# H200: the one-row GGUF matmul configs that hold several weight rows per thread (BLOCK_B = 32 x
# warps, so x's int8 words are read once per block for every row a thread holds), swept beside
# the defaults; then batch-1 decode on the engine (bf16), Q4_0 on the default kind and Q4_0 on
# int8x at the sweep's fastest configs (SUITE_INT8X), in one suite run. Carry .whl and .smol_tok.
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
ROWS="${ROWS:-int8x:4:1024:4,int8x:8:4096:4,int8x:16:4096:4,int8x:8:2048:2,int8x:16:2048:2,int8x:8:1024:1,int8x:8:8192:4,int8x:16:4096:2,dp4a:4:1024:4,dp4a:8:4096:4,dp4a:16:4096:4}"
T_TAIL=60 t 240 python3 benchmarks/quant_gpu.py --ms 1 --kinds int8x,dp4a --configs "$ROWS" --out "$OUT/quant_gpu_rows.json"
export SUITE_INT8X=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['int8x_fastest']['suite_int8x'])" "$OUT/quant_gpu_rows.json")
echo "SUITE_INT8X=$SUITE_INT8X"
SUITE_QUANT_VARIANTS=q4_0,q4_0_int8x T_TAIL=40 t 200 python3 benchmarks/suite.py --device cuda --workers engine,quant --engine-steps decode_b1 --out "$OUT/suite_q4_int8x.json"
T_TAIL=8 t 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py -k gpu
