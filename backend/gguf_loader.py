"""GGUF files: the model config from the header (rope scaling from rope.scaling.* and the
rope_freqs tensor, the sliding window), the tokenizer converted once into the local cache, and
the weights under HF names, either kept as GGUF blocks (QuantTensor) or dequantized to float32.
No fp32 copy of the weights is written unless `export_hf_folder` is asked for one."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .gguf_file import GGUFFile, LongArray
from .model_config import ModelConfig
from .quant_formats import BLOCKS, QuantTensor

logger = logging.getLogger(__name__)
SOURCE_FILE = "gguf_source"  # in a cache folder: the GGUF file its weights come from
ARCHES = ("llama", "qwen2", "qwen3", "mistral")
FLOAT_TYPES = ("F32", "F16", "BF16")


def cache_root() -> Path:
    root = Path(os.environ.get("RADIXLM_CACHE", Path.home() / ".cache" / "radixlm"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _cache_dir(path: Path, kind: str) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}:{kind}".encode()).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{key}"


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a cache folder stands for (its weights are read from there), or None."""
    f = model_dir / SOURCE_FILE
    return Path(f.read_text()) if f.exists() else None


def prepare_gguf_dir(path: Path) -> Path:
    """A cache folder with config.json and the tokenizer for a GGUF file (weights stay in the
    GGUF); made once, the tokenizer conversion being the slow part. A GGUF without a tokenizer
    gets config.json only (pass Engine a tokenizer_path)."""
    out = _cache_dir(path, "v3")
    if (out / SOURCE_FILE).exists():
        return out
    reader = _reader(path)
    config = gguf_config(reader, path.stem)
    cfg = config.to_hf_dict()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    if reader.field("tokenizer.ggml.model") is not None:
        from transformers import AutoTokenizer

        logger.warning("first use of %s: converting its tokenizer to %s (once; a few s)", path.name, out)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.save_pretrained(str(tmp))
        if tok.eos_token_id is not None and not config.eos_token_ids:
            cfg["eos_token_id"] = tok.eos_token_id
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / SOURCE_FILE).write_text(str(path.resolve()))
    _publish(tmp, out)
    return out


def _publish(tmp: Path, out: Path) -> None:
    try:
        tmp.rename(out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)


def _reader(path: Path) -> GGUFFile:
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: object = None) -> Any:
    return reader.field(key, default)


def gguf_config(reader: GGUFFile, name: str) -> ModelConfig:
    arch = str(_field(reader, "general.architecture"))
    if arch not in ARCHES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({', '.join(ARCHES)})")

    def g(key: str, default: object = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    d: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": int(g("vocab_size", _length(reader.field("tokenizer.ggml.tokens", [])))),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch),
        "max_position_embeddings": int(g("context_length", 4096)),
        "sliding_window": g("attention.sliding_window"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": arch == "qwen2",
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
    }
    return ModelConfig.from_hf_dict(d, model_name=str(_field(reader, "general.name", name)))


def _length(a: list[Any] | LongArray) -> int:
    return a.length if isinstance(a, LongArray) else len(a)


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    """llama.cpp's rope scaling: rope.scaling.type/factor (linear) and the rope_freqs tensor,
    per-frequency divisors of the inverse frequencies (how it stores Llama-3.1/3.2's llama3
    scaling). Both apply when both are present, as in llama.cpp."""
    kind = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind not in ("none", "linear"):
        raise ValueError(
            f"GGUF rope scaling {kind!r} is not implemented (supported: none, linear, rope_freqs)"
        )
    freqs = next((t for t in reader.tensors if t.name.startswith("rope_freqs")), None)
    if freqs is not None:
        factors = np.asarray(freqs.data, dtype=np.float64).reshape(-1) * (factor if kind == "linear" else 1.0)
        return {"rope_type": "freq_factors", "factors": factors.tolist()}
    if kind == "linear" and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    return None


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}  # fmt: skip


def hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, layer, module, kind = name.split(".")
    return f"model.layers.{layer}.{_GGUF_NAMES[module]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp interleaves the rotary halves of q/k rows for llama-arch models; undo it. Rows
    move whole, so this works on float rows and on rows of GGUF blocks alike."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iter_gguf_weights(
    path: Path, config: ModelConfig, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """(HF name, weight) for every tensor but rope_freqs (read into the config): float tensors as
    float32, quantized ones as QuantTensor blocks or, with keep_quantized False, dequantized."""
    import gguf

    for t in _reader(path).tensors:
        if t.name.startswith("rope_freqs"):
            continue
        name, qtype = hf_name(t.name), t.type_name
        cols = int(t.shape[0])
        data = t.data
        if config.model_type in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
            data = _unpermute(data, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        if qtype in FLOAT_TYPES:
            w = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(
                [int(x) for x in reversed(t.shape)]
            )
            yield name, w
        elif qtype in BLOCKS:
            qt = QuantTensor(qtype, torch.from_numpy(np.array(data)), cols)
            yield name, qt if keep_quantized else qt.dequantize()
        else:  # formats without a torch reading here: gguf's own dequantization, once at load
            arr = gguf.quants.dequantize(np.array(data), gguf.GGMLQuantizationType[qtype]).astype(np.float32)
            yield name, torch.from_numpy(arr.reshape(-1, cols))


def export_hf_folder(path: Path) -> Path:
    """An fp32 HF folder (config, safetensors, tokenizer) for a GGUF file, cached: the reference
    transformers loads in tests and benchmarks. The engine never needs it."""
    from safetensors.torch import save_file

    out = _cache_dir(path, "hf-fp32-v4")
    if (out / "done").exists():
        return out
    src = prepare_gguf_dir(path)
    config = ModelConfig.from_hf_dict(json.loads((src / "config.json").read_text()))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    # not SOURCE_FILE: this folder is an HF folder, its weights are the safetensors
    shutil.copytree(src, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(SOURCE_FILE))
    state: dict[str, torch.Tensor] = {}
    for n, w in iter_gguf_weights(path, config, keep_quantized=False):
        assert isinstance(w, torch.Tensor)  # keep_quantized=False dequantizes every block format
        state[n] = w.contiguous()
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "done").write_text(str(path.resolve()))
    _publish(tmp, out)
    return out
