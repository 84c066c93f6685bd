"""Quantization of float weights after load (HF safetensors, or random weights of a model shape):
"q4_0" / "q4_1" / "q8_0" write GGUF blocks exactly as ggml's reference quantizer does and run
them through QuantLinear (the LM head as Q8_0); "fp8" keeps e4m3 weights with one scale per
output row (Fp8Linear). Promises: only the decoder layers' linears change (and, for the GGUF
formats, the LM head); the token embedding stays in the model dtype."""

from __future__ import annotations

import logging

from torch import nn

from radixlm.kernels.quant_blocks import quantize_blocks

from .fp8_linear import Fp8Linear, runs_fp8_matmuls
from .models.llama import LlamaForCausalLM
from .quant_formats import QuantTensor
from .quant_linear import QuantLinear

logger = logging.getLogger(__name__)

ON_LOAD = ("fp8", "q4_0", "q4_1", "q8_0")
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_linears(model: LlamaForCausalLM, method: str) -> None:
    """Replace the float linears of model (a LlamaForCausalLM) by their quantized form."""
    if method not in ON_LOAD:
        raise ValueError(f"unknown load-time quantization {method!r}; choose from {', '.join(ON_LOAD)}")
    paths = {
        f"model.layers.{i}.{name}": method for i in range(len(model.model.layers)) for name in LAYER_LINEARS
    }
    device = model.lm_head.weight.device
    if method == "fp8" and not runs_fp8_matmuls(device):
        logger.warning(
            "quantization='fp8' on %s: nothing here multiplies in fp8, so every matmul dequantizes its "
            "weights; that saves weight memory but decodes slower than the float model (q8_0 and q4_0 "
            "keep their blocks in the matmul on the CPU and on GPUs)",
            device,
        )
    if method != "fp8":
        # the LM head in 8 bits, as llama.cpp keeps its output at 6+ bits in 4-bit files: on the
        # default model with Q4_1 layers, a Q4_0 head took the logits' error from 1% to 7%
        paths["lm_head"] = "q8_0"
    for path, how in paths.items():
        old = model.get_submodule(path)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{path} is already quantized ({type(old).__name__}); load float weights")
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, _quantized(old, how))


def _quantized(layer: nn.Linear, method: str) -> nn.Module:
    if method == "fp8":
        return Fp8Linear.from_linear(layer)
    qtype = method.upper()
    w = layer.weight.detach()
    if w.shape[1] % 32:
        raise ValueError(f"{qtype} needs input widths that are multiples of 32, got {w.shape[1]}")
    qt = QuantTensor(qtype, quantize_blocks(w, qtype), w.shape[1])
    bias = None if layer.bias is None else layer.bias.detach()
    return QuantLinear([qt], bias, w.device, w.dtype)


__all__ = ["LAYER_LINEARS", "ON_LOAD", "quantize_linears"]
