# H200: the end-to-end suite on default settings (benchmarks/suite.py), full log and results in
# $OUT. Carry .whl and .smol_tok (benchmarks/h200/prepare.sh makes both here).
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok   # tokenizer only: the random shapes need no weights
set -o pipefail
if [ -n "${GPU_TESTS:-}" ]; then  # the GPU-only tests first (they skip on CPU machines)
  timeout "${GPU_TESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider tests/*_gpu.py 2>&1 | tail -n 30
fi
timeout "${SUITE_LIMIT:-570}" python3 benchmarks/suite.py --device cuda --out "$OUT/suite_h200.json" ${SUITE_ARGS:-} 2>&1 \
  | grep -v "it/s]" | tee "$OUT/suite_log.txt"
echo "=== suite rc=$?"
ls -la "$OUT"
