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
