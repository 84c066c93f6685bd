# H200: overlap scheduling + fused projections end to end on the llama-3.1-8b shape (random bf16
# weights): GPU tests, batch-1 decode vs the weight-streaming roofline (overlap on vs off), batch
# 128 (overlap on vs off), and a decode profile. Stashes half the default GGUF for a later call.
source benchmarks/h200/setup.sh
mkdir -p .gguf_store && cp .gguf_a/* .gguf_store/
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok   # tokenizer only: the random shapes need no weights
R=benchmarks/results
t 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_overlap_gpu.py tests/test_engine_gpu.py -k "llama_8b or overlap or sync"
t 100 python3 benchmarks/offline_throughput.py --model-shape llama-3.1-8b --device cuda --num-prompts 1 \
  --input-len 512 --output-len 256 --range-ratio 1 --context-length 8192 --compare-overlap --out $R/offline_throughput_h200_b1.json
t 90 python3 benchmarks/profile_decode.py --batch 1 --steps 64 --out $OUT/profile_b1.json
t 150 python3 benchmarks/offline_throughput.py --model-shape llama-3.1-8b --device cuda --num-prompts 128 \
  --input-len 512 --output-len 256 --range-ratio 1 --context-length 8192 --compare-overlap \
  --out $R/offline_throughput_h200_b128_overlap.json
cp $R/*h200*.json "$OUT"/ 2>/dev/null; ls -la "$OUT"
