# Programmatic dependent launch on the GPU: its GPU test (a tiny model decoding alike with PDL on
# and off, graphs and overlap on), then the suite's batch-1 decode (bf16 and Q4_0, with Q4_0 at
# B=128) on the code before PDL and with it, alternating (benchmarks/h200/suite_ab.sh, packs in
# .ab/pdl; VERSIONS="old new pre" adds a third pack), then the HF parity test through graphs.
# Pack first, here:  AB=.ab/pdl bash benchmarks/h200/suite_ab.sh pack REV_BEFORE REV_WITH_PDL
# and carry .whl, .smol_tok and .ab. Results: $OUT/pdl/ab.tgz (suite_ab_report.py --packs .ab/pdl).
# SKIP_TEST=1 skips the tests; N rounds (default 2).
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
[ -n "${SKIP_TEST:-}" ] || T_TAIL=12 t 120 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py
mkdir -p "$OUT/pdl"
AB=.ab/pdl N=${N:-2} RUN_LIMIT=150 SUITE_ARGS="--workers engine,quant --engine-steps decode_b1" OUT=$OUT/pdl \
  bash benchmarks/h200/suite_ab.sh run
[ -n "${SKIP_TEST:-}" ] || T_TAIL=12 t 120 python3 -m pytest -q -p no:cacheprovider tests/test_hf_parity_gpu.py
