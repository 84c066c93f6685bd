# H200: the end-to-end suite on default settings (benchmarks/suite.py), full log and results in
# $OUT. Carry .whl and .smol_tok (benchmarks/h200/prepare.sh makes both here).
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok   # tokenizer only: the random shapes need no weights
set -o pipefail
if [ -n "${GPU_TESTS:-}" ]; then  # the GPU-only tests first (they skip on CPU machines), a process
  # per file: an engine a module keeps alive must not starve the next module's engines
  timeout "${GPU_TESTS_LIMIT:-300}" bash -c 'for f in tests/*_gpu.py; do echo "== $f";
    python3 -m pytest -q -p no:cacheprovider "$f" 2>&1 | grep -E "passed|failed|skipped|error|FAILED|ERROR" | tail -n 8; done'
fi
# an "nvidia-h200" call may land on an H100: name the result by the card that ran it, and compare
# with that card's committed run (COMPARE=path to pick another, COMPARE= for none)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" in *H200*) tag=h200;; *) tag=h100;; esac
compare=${COMPARE-benchmarks/results/suite_$tag.json}
timeout "${SUITE_LIMIT:-570}" python3 benchmarks/suite.py --device cuda --out "$OUT/suite_$tag.json" \
  ${compare:+--compare "$compare"} ${SUITE_ARGS:-} 2>&1 | grep -v "it/s]" | tee "$OUT/suite_log.txt"
echo "=== suite rc=$?"
ls -la "$OUT"
