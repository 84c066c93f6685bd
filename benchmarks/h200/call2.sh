# H200 call 2: reassemble the default model (half stashed by call 1); SmolLM2 bf16 vs HF, the
# Triton and CUDA-graph paths; then constrained decoding, serving and program benchmarks.
source benchmarks/h200/setup.sh
cat .gguf_store/ggpart_00 .gguf_b/ggpart_01 > /tmp/smollm2.gguf && md5sum /tmp/smollm2.gguf
export RADIXLM_DEFAULT_MODEL=/tmp/smollm2.gguf
R=benchmarks/results
T_TAIL=30
t 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_engine_gpu.py tests/test_cuda_graph_gpu.py -k "not llama_8b"
t 90 python3 benchmarks/constrained_decode.py --model-shape llama-3.1-8b --device cuda --batch 64
t 100 python3 benchmarks/serving.py --launch --device cuda --random-weights --model-shape llama-3.1-8b \
  --num-prompts 200 --input-len 512 --output-len 128 --request-rates 8,inf --out $R/serving_h200.json
t 80 python3 benchmarks/programs.py --batch 16 --repeats 2 --engine-args '{"device": "cuda"}' --out $R/programs_h200.json
cp $R/*h200*.json "$OUT"/ 2>/dev/null; ls -la "$OUT"
