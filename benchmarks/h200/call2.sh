# H200 call 2: reassemble the default model (half stashed by call 1) and check SmolLM2 in bf16
# against HF, the Triton and CUDA-graph paths, then the program and serving benchmarks.
source benchmarks/h200/setup.sh
cat .gguf_store/ggpart_00 .gguf_b/ggpart_01 > /tmp/smollm2.gguf && md5sum /tmp/smollm2.gguf
export RADIXLM_DEFAULT_MODEL=/tmp/smollm2.gguf
R=benchmarks/results
t() { local lim=$1; shift; echo "=== $*"; timeout "$lim" "$@" 2>&1 | tail -n 40; echo "=== rc=${PIPESTATUS[0]}"; }
t 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_engine_gpu.py -k "not llama_8b"
t 120 python3 benchmarks/offline_throughput.py --device cuda --num-prompts 64 --input-len 256 --output-len 128 \
  --compare-hf --out $R/offline_throughput_h200_smollm2.json
t 150 python3 benchmarks/serving.py --launch --device cuda --random-weights --model-shape llama-3.1-8b \
  --num-prompts 256 --input-len 512 --output-len 128 --request-rates 8,inf --out $R/serving_h200.json
t 120 python3 benchmarks/programs.py --batch 16 --repeats 2 --engine-args '{"device": "cuda"}' --out $R/programs_h200.json
cp $R/*h200*.json "$OUT"/ 2>/dev/null; ls -la "$OUT"
