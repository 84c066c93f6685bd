"""ModelConfig: the few numbers the Llama-family implementation switches on, read from an HF
config.json dict, a GGUF header, or a named real shape (for random-weight benchmarks)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    # Mistral-style sliding-window attention: full attention over at most this many tokens
    # equals it, so the context is capped there (the attention kernels have no window)
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2/2.5: q/k/v projections have biases
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    hidden_act: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    model_name: str = ""

    @property
    def context_len(self) -> int:
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], model_name: str = "") -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; radixlm supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")  # transformers ≥ 5 folds theta + scaling in here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        window = _sliding_window(d)
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; only silu (SwiGLU) is implemented")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            sliding_window=window,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            model_name=model_name or d.get("_name_or_path", "") or model_type,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF config.json for this shape (what GGUF conversion writes)."""
        d: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM" if self.qk_norm else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "torch_dtype": "float32",
        }
        return d


def _sliding_window(d: dict[str, Any]) -> int | None:
    """The attention window that is in force (Qwen2 keeps one in its config but switches it off
    with use_sliding_window); logged when it caps the context."""
    window = d.get("sliding_window")
    if not window or not d.get("use_sliding_window", True):
        return None
    max_pos = d.get("max_position_embeddings", 4096)
    if int(window) < max_pos:
        logger.warning(
            "sliding_window %d < max_position_embeddings %d: context capped at %d tokens (full "
            "attention over at most the window equals sliding-window attention; longer is not implemented)",
            window,
            max_pos,
            window,
        )
    return int(window)


# Real shapes for random-weight benchmarks: speed does not depend on the values.
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
    },
    # A forward that costs almost nothing (the default tokenizer's vocabulary, 2 narrow layers): on a
    # CPU, host overhead (scheduler, language) shows in it the way it does beside a fast GPU.
    "smollm2-tiny": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "bos_token_id": 1,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "eos_token_id": 151645,
    },
}


def named_shape_config(name: str) -> ModelConfig:
    if name not in NAMED_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(NAMED_SHAPES))}")
    return ModelConfig.from_hf_dict(NAMED_SHAPES[name], model_name=f"{name} (random weights)")
