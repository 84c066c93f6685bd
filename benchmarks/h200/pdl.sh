# Programmatic dependent launch (RADIXLM_PDL=1) against the default, on one code version: its GPU
# test (a tiny model decoding alike with PDL on and off, graphs and overlap on), then batch-1
# decode in the suite (bf16 and Q4_0, with Q4_0 at B=128), PDL off and on alternating, then the
# batch-1 Q4_0 decode step profiled each way (kernel times, and device-busy against wall time per
# step: where PDL gains or loses). Carry .whl and .smol_tok. N rounds (default 2); SKIP_TEST=1.
source benchmarks/h200/setup.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok SUITE_QUANT_VARIANTS=q4_0
[ -n "${SKIP_TEST:-}" ] || T_TAIL=12 t 120 python3 -m pytest -q -p no:cacheprovider tests/test_pdl.py
for i in $(seq 1 "${N:-2}"); do
  for p in 0 1; do
    RADIXLM_PDL=$p T_TAIL=6 t 120 python3 benchmarks/suite.py --device cuda --workers engine,quant \
      --engine-steps decode_b1 --out "$OUT/suite_pdl${p}_$i.json"
  done
done
for p in 0 1; do
  RADIXLM_PDL=$p T_TAIL=20 t 90 python3 benchmarks/profile_decode.py --quantization q4_0 --out "$OUT/profile_q4_pdl$p.json"
done
