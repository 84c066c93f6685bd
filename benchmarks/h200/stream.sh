# The persistent one-row matmul ("stream", kernels/quant_gemv_stream.py) swept beside today's
# one-row defaults on the 8B shapes, then batch-1 decode on the engine: bf16, Q4_0 on the default
# choice and Q4_0 with the sweep's fastest stream configs (SUITE_STREAM), in one suite run; then
# the GPU kernel test. Carry .whl and .smol_tok. SWEEP_ONLY=1 stops after the sweep.
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
BASE="int8x:1:1024:1,dp4a:4:1024:4,dp4a:4:2048:4:3"
STREAMS="${STREAMS:-stream:1:1024:1:1:32,stream:1:1024:1:3:32,stream:1:1024:1:4:28,stream:1:2048:1:3:22,stream:1:2048:1:4:15,stream:1:4096:1:2:20,stream:1:4096:1:3:24,stream:2:1024:1:3:22,stream:4:1024:4:3:12,stream:1:2048:2:3:22}"
T_TAIL=40 t 300 python3 benchmarks/quant_gpu.py --ms 1 --kinds int8x,dp4a,stream --configs "$BASE,$STREAMS" --out "$OUT/quant_gpu_stream.json"
[ -n "${SWEEP_ONLY:-}" ] && exit 0
SUITE_STREAM=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['stream_fastest']['suite_stream'])" "$OUT/quant_gpu_stream.json" 2>/dev/null || echo 1:1024:1:3:32)
export SUITE_STREAM; echo "SUITE_STREAM=$SUITE_STREAM"
SUITE_QUANT_VARIANTS=q4_0,q4_0_stream T_TAIL=40 t 180 python3 benchmarks/suite.py --device cuda --workers engine,quant --engine-steps decode_b1 --out "$OUT/suite_q4_stream.json"
T_TAIL=8 t 100 python3 -m pytest -q -p no:cacheprovider tests/test_quant_kernels.py -k gpu
