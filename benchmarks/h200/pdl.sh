# Programmatic dependent launch per kernel: its GPU test (a tiny model decoding alike with PDL on
# and off, graphs and overlap on), then batch-1 decode of the 8B shape under PDL settings
# (benchmarks/pdl_sweep.py: none, all with early and late release, all but some kernels),
# Q4_0 then bf16, rounds alternating. Carry .whl and .smol_tok. ROUNDS (default 2); SKIP_TEST=1.
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok
[ -n "${SKIP_TEST:-}" ] || T_TAIL=12 t 120 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py
Q4_SETTINGS=${Q4_SETTINGS:-"0 1 1:exit 1:early=1 all-gemv_dp4a all-gemv_int8x"}
BF16_SETTINGS=${BF16_SETTINGS:-"0 1 1:exit 1:early=1"}
T_TAIL=30 t 280 python3 benchmarks/pdl_sweep.py --quantization q4_0 --settings $Q4_SETTINGS \
  --rounds "${ROUNDS:-2}" --out "$OUT/pdl_sweep_q4_0.json"
T_TAIL=30 t 200 python3 benchmarks/pdl_sweep.py --quantization none --settings $BF16_SETTINGS \
  --rounds "${ROUNDS:-2}" --out "$OUT/pdl_sweep_bf16.json"
