# H200, last call: GPU tests (overlap, cascade CUDA graph vs plain), the fork-heavy workload with
# cascade on vs off, batch-1 decode vs the roofline (overlap on vs off), batch 128 vs HF
# transformers generate, and the cascade kernel at its adopted defaults vs plain decode / FlashInfer.
source benchmarks/h200/setup.sh
source benchmarks/h200/flashinfer.sh
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok   # tokenizer only: the random shapes need no weights
R=benchmarks/results
T_TAIL=30
t 80 python3 -m pytest -q -p no:cacheprovider tests/test_overlap_gpu.py
t 130 python3 benchmarks/forks.py --model-shape llama-3.1-8b --device cuda --out $OUT/forks_h200.json
t 80 python3 benchmarks/offline_throughput.py --model-shape llama-3.1-8b --device cuda --num-prompts 1 \
  --input-len 512 --output-len 256 --range-ratio 1 --context-length 8192 --compare-overlap --out $OUT/offline_throughput_h200_b1.json
t 150 python3 benchmarks/offline_throughput.py --model-shape llama-3.1-8b --device cuda --num-prompts 128 \
  --input-len 512 --output-len 256 --range-ratio 1 --compare-hf --mem-fraction-static 0.55 --context-length 8192 \
  --out $OUT/offline_throughput_h200.json
t 110 python3 benchmarks/kernels.py "$OUT" --only cascade
ls -la "$OUT"
