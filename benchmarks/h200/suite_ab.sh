# H200: the suite on two code versions, alternating in one call (old, new, old, new, ...), so
# a change is judged against the code before it on the same machine and the same day.
# Pack the versions first, here:  benchmarks/h200/suite_ab.sh pack REV_OLD REV_NEW
# (writes .ab/old.tar and .ab/new.tar), then on the device, carrying .whl, .smol_tok and .ab:
#   N=2 SUITE_ARGS="--workers engine --engine-steps decode_b1,prefix,prefix_cascade_off,forks" \
#     bash benchmarks/h200/suite_ab.sh run
# Every result goes into one $OUT/ab.tgz (the device returns only a few files per call), rewritten
# after each run. AB=DIR packs into / runs from DIR instead of .ab (two A/Bs carried in one call);
# give suite_ab_report.py the same folder (--packs DIR).
# An A/B longer than one call: split it by workers over back-to-back calls (SUITE_ARGS="--workers
# engine", then "--workers radix_off,hf,server"), extract each call's ab.tgz into a folder of its
# own, and compare: python benchmarks/suite_ab_report.py CALL1_DIR CALL2_DIR (it merges them).
# ENV_old / ENV_new: environment settings for one version's runs, e.g. a switch judged on one
# code version packed twice: pack HEAD HEAD, then ENV_new="RADIXLM_PDL=1".
set -u
AB=${AB:-.ab}
if [ "${1:-}" = pack ]; then
  mkdir -p "$AB"
  git archive "$2" -o "$AB/old.tar" -- . ':!benchmarks/results' ':!docs'
  git archive "$3" -o "$AB/new.tar" -- . ':!benchmarks/results' ':!docs'
  exit 0
fi
ROOT=$PWD
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RADIXLM_DEFAULT_MODEL=$ROOT/.smol_tok
for v in ${VERSIONS:-old new}; do  # each version installed into its own folder (INSTALLED=1: done)
  [ -n "${INSTALLED:-}" ] && break
  W=/tmp/ab_$v; rm -rf "$W"; mkdir -p "$W/src"; tar -xf "$AB/$v.tar" -C "$W/src"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$ROOT"/.whl/*.whl || exit 1
  (cd "$W/src" && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$W/site" .) || exit 1
done
mkdir -p /tmp/abres
for i in $(seq 1 "${N:-2}"); do
  for v in ${VERSIONS:-old new}; do
    settings="ENV_$v"
    (cd "/tmp/ab_$v/src" && env ${!settings:-} PYTHONPATH="/tmp/ab_$v/site" timeout "${RUN_LIMIT:-300}" python3 benchmarks/suite.py \
      --device cuda --out "/tmp/abres/ab_${v}_$i.json" ${SUITE_ARGS:-} > "/tmp/abres/ab_${v}_$i.log" 2>&1
     echo "$v $i rc=$? $(date +%T)")
    tar -czf "$OUT/ab.tgz" -C /tmp/abres .  # after every run: a call cut off at its limit keeps what ran
  done
done
