# H200 call 1: the llama-3.1-8b shape with random weights (correctness, then the benchmarks).
# Also stashes the first half of the default model's GGUF for call 2 (the tree may carry 64 MiB).
source benchmarks/h200/setup.sh
mkdir -p .gguf_store && cp .gguf_a/* .gguf_store/
export RADIXLM_DEFAULT_MODEL=$PWD/.smol_tok   # tokenizer only: the random shapes need no weights
R=benchmarks/results
T_TAIL=30
t 60 python3 -m pytest -q -s -p no:cacheprovider tests/test_engine_gpu.py -k "llama_8b"
t 130 python3 benchmarks/offline_throughput.py --model-shape llama-3.1-8b --device cuda --num-prompts 128 \
  --input-len 512 --output-len 256 --range-ratio 1 --compare-hf --mem-fraction-static 0.55 --context-length 8192 --out $R/offline_throughput_h200.json
t 45 python3 benchmarks/offline_throughput.py --model-shape llama-3.1-8b --device cuda --num-prompts 1 \
  --input-len 512 --output-len 256 --range-ratio 1 --context-length 8192 --out $R/offline_throughput_h200_b1.json
t 130 python3 benchmarks/prefix_sharing.py --device cuda --random-weights --model-shape llama-3.1-8b
cp $R/*h200*.json "$OUT"/ 2>/dev/null; ls -la "$OUT"
