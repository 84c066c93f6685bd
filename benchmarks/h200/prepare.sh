# Run here (not on the device) before the first GPU call of a checkout: the wheels the device
# image lacks (.whl) and the default model's tokenizer and config (.smol_tok), both git-ignored.
# Every H200 script then takes carry [".whl", ".smol_tok"] (plus ".ab" for suite_ab.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -d .whl ]; then
  bash ../shared/tools/gpu_wheels.sh .whl jsonschema jsonschema-specifications referencing rpds-py jsonschema-rs
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1  # its wheel is manylinux_2_31 only
fi
if [ ! -d .smol_tok ]; then  # the converted default model's folder, less its weights
  python3 -c "from radixlm.backend.engine import Engine; Engine().shutdown()"
  src=$(ls -d ~/.cache/radixlm/SmolLM2-135M-Instruct.* | head -n 1)
  mkdir -p .smol_tok
  cp "$src"/{chat_template.jinja,config.json,tokenizer.json,tokenizer_config.json} .smol_tok/
fi
du -sh .whl .smol_tok
# The GPU tests that load the default model's weights need its GGUF (98 MB, over one call's 64 MiB):
# GGUF=1 splits it into .gguf_a and .gguf_b; carry one per back-to-back call, each call first
# copying its part to /tmp/gguf/ (outside the tree), then `cat /tmp/gguf/a /tmp/gguf/b > /tmp/m.gguf`
# and RADIXLM_DEFAULT_MODEL=/tmp/m.gguf for the tests.
if [ -n "${GGUF:-}" ] && [ ! -d .gguf_a ]; then
  src=$(python3 -c "from radixlm.backend.loader import default_model_path; print(default_model_path())")
  mkdir -p .gguf_a .gguf_b
  head -c 50000000 "$src" > .gguf_a/part && tail -c +50000001 "$src" > .gguf_b/part
  du -sh .gguf_a .gguf_b
fi
