# Sourced at the start of every H200 call: offline wheels, radixlm itself, the tokenizer, and
# t LIMIT CMD... (run with a time limit, print the tail of its output and its exit status).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
t() { local lim=$1; shift; echo "=== $*"; timeout "$lim" "$@" 2>&1 | grep -v "it/s]" | tail -n "${T_TAIL:-40}"; echo "=== rc=${PIPESTATUS[0]}"; }
