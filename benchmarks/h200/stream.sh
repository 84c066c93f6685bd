# The persistent one-row matmul ("stream", kernels/quant_gemv_stream.py) swept beside today's
# one-row defaults on the 8B shapes (configs whose one tile spans K, x read once per program; the
# programs per multiprocessor what their registers and shared memory let reside), then batch-1
# decode on the engine: bf16, Q4_0 on the default choice and Q4_0 with the sweep's fastest stream
# configs per role (SUITE_STREAM, short/long/rest), in one suite run; then the GPU kernel test.
# Carry .whl and .smol_tok. SWEEP_ONLY=1 stops after the sweep, SKIP_TEST=1 before the test.
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
BASE="int8x:1:1024:1,dp4a:4:1024:4"
STREAMS="${STREAMS:-stream:1:4096:1:2:21,stream:1:4096:1:3:25,stream:1:4096:2:3:18,stream:1:16384:4:3:16,stream:1:16384:4:2:6,stream:1:16384:8:2:5,stream:1:16384:8:3:5,stream:1:16384:16:2:4}"
T_TAIL=40 t 160 python3 benchmarks/quant_gpu.py --ms 1 --kinds int8x,dp4a,stream --configs "$BASE,$STREAMS" --out "$OUT/quant_gpu_stream.json"
[ -n "${SWEEP_ONLY:-}" ] && exit 0
SUITE_STREAM=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['stream_fastest']['suite_stream'])" "$OUT/quant_gpu_stream.json" 2>/dev/null || echo 1:4096:1:2:21/-/-)
export SUITE_STREAM; echo "SUITE_STREAM=$SUITE_STREAM"
SUITE_QUANT_VARIANTS=q4_0,q4_0_stream T_TAIL=30 t 150 python3 benchmarks/suite.py --device cuda --workers engine,quant --engine-steps decode_b1 --out "$OUT/suite_q4_stream.json"
[ -n "${SKIP_TEST:-}" ] || T_TAIL=8 t 140 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py -k gpu
