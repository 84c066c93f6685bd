"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM) with config switches:
qkv bias, q/k RMSNorm, tied embeddings, llama3 rope scaling. q/k/v and gate/up are each one
fused matmul (HF's separate weights are stacked at load) and the residual add is fused into
the next RMSNorm; where a one-row GGUF matmul reads its input rounded to int8, the norm or
SiLU-and-mul before it rounds it in the same launch. Attention goes through the ForwardBatch's
backend, which owns the paged KV pool; the model owns only weights."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import cpu_decode
from radixlm.kernels.quant_gemv_int8x import Int8Row
from radixlm.kernels.silu_and_mul import silu_mul, silu_mul_int8

from ..attention import TorchAttentionBackend
from ..forward_batch import ForwardBatch
from ..model_config import ModelConfig
from ..quant_formats import QuantTensor
from ..quant_linear import install_quantized
from ..tensor_parallel import StepSender, TPShard, embed_rows, gather_logits, reduce_partial
from .cpu_layers import CpuDecodeLayers
from .linear import Layer, linear, native, reads_int8
from .norm import RMSNorm, few_f32_rows
from .rotary import RotaryEmbedding, project_rotate_and_store, rotate_and_store


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch, x_int8: Int8Row | None = None
    ) -> torch.Tensor:
        t = x.shape[0]
        backend = fb.attn_backend
        if fb.is_decode and x.is_cuda and backend.accepts_stored_kv and self.q_norm is None:
            heads = (self.num_heads, self.num_kv_heads, self.head_dim)
            q = project_rotate_and_store(self.rope, self.qkv_proj, positions, x, fb, self.layer_id, heads)
            if q is not None:  # the GGUF qkv matmul rotated q and k and stored k and v itself
                return linear(self.o_proj, backend.forward(q, None, None, self.layer_id, fb))
        qkv = linear(self.qkv_proj, x, x_int8)
        if self.q_norm is None and self._fused_cpu(fb, qkv):
            return native(self.o_proj, self._rope_store_attend(positions, qkv, fb))
        if not qkv.is_cuda and self.q_norm is None:
            # q and k sit side by side in qkv: one rotation covers both (fewer small CPU ops)
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, -1)
            q, k = self.rope.rotate(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
            return native(self.o_proj, fb.attn_backend.forward(q, k, v, self.layer_id, fb))
        q, k, v = self._heads(qkv)
        if fb.is_decode and q.is_cuda and backend.accepts_stored_kv:
            pool = fb.kv_pool  # decode reads all K/V from the pool: rope writes k (and v) there itself
            q = rotate_and_store(
                self.rope,
                positions,
                q,
                k,
                v,
                pool.k_buffers[self.layer_id],
                pool.v_buffers[self.layer_id],
                fb.out_cache_loc,
                *pool.store_scales(self.layer_id),
            )
            return linear(self.o_proj, backend.forward(q, None, None, self.layer_id, fb))
        q, k = self.rope(positions, q, k)
        return linear(self.o_proj, backend.forward(q, k, v, self.layer_id, fb))

    def project(
        self, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The work before attention for several rows: (q, k rotated, v) [T, heads, D]."""
        q, k, v = self._heads(linear(self.qkv_proj, x))
        q, k = self.rope(positions, q, k)
        return q, k, v

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2 Hkv) D] → q, k, v views [T, heads, D] (q and k normed where the
        model has q/k norms)."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _fused_cpu(self, fb: ForwardBatch, qkv: torch.Tensor) -> bool:
        """One request's few new tokens (a decode token, or a verify step's token and drafts) on
        the CPU with a float32 pool the torch backend reads: rope, KV store and attention run as
        one C call (radixlm.kernels.cpu_decode), each token as decode would run it. An fp8 pool
        fails the float32 check and takes the torch backend, which quantizes and dequantizes."""
        return (
            fb.batch_size == 1
            and not qkv.is_cuda
            and isinstance(fb.attn_backend, TorchAttentionBackend)
            and few_f32_rows(qkv, fb.kv_pool.k_buffers[self.layer_id], fb.kv_pool.v_buffers[self.layer_id])
            and cpu_decode.available()
        )

    def _rope_store_attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        cos, sin_signed = self.rope.rows(positions)
        slots = fb.req_to_token[fb.req_pool_indices_cpu[0], : fb.seq_lens_cpu[0]]
        pool = fb.kv_pool
        return cpu_decode.rope_store_attend(
            qkv,
            (self.num_heads, self.num_kv_heads, self.head_dim),
            cos,
            sin_signed,
            pool.k_buffers[self.layer_id],
            pool.v_buffers[self.layer_id],
            fb.out_cache_loc,
            slots,
        )


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, x_int8: Int8Row | None = None) -> torch.Tensor:
        if not x.is_cuda:  # bf16 from the packed matmul on: the down projection casts to it anyway
            gate_up = native(self.gate_up_proj, x)
            if few_f32_rows(gate_up) and cpu_decode.available():  # one C call, as the one-call loop
                return native(self.down_proj, cpu_decode.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return native(self.down_proj, F.silu(gate) * up)
        return self.forward_fused(x, x_int8)

    def forward_fused(self, x: torch.Tensor, x_int8: Int8Row | None = None) -> torch.Tensor:
        """The path of the GPU kernels (on CUDA, or under Triton's interpreter)."""
        gate, up = linear(self.gate_up_proj, x, x_int8).chunk(2, dim=-1)
        if reads_int8(self.down_proj, gate):
            return linear(self.down_proj, *silu_mul_int8(gate, up))
        return linear(self.down_proj, silu_mul(gate, up))  # fused SiLU-and-mul kernel on the GPU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rope)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # tensor parallel (backend/tensor_parallel.py): this rank's attention and MLP outputs are
        # partial sums over its heads / columns, completed by an all-reduce
        self.tp_size = 1

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): the caller adds the two, fused
        into the next RMSNorm."""
        h, residual, h_int8 = _norm(self.input_layernorm, h, residual, self.self_attn.qkv_proj)
        return self._mlp_block(self._reduce(self.self_attn(positions, h, fb, h_int8)), residual)

    def before_attention(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dense work ahead of attention for several rows (the piecewise graphs' first half of
        a layer): (q, k rotated, v, the residual stream)."""
        h, residual, _ = _norm(self.input_layernorm, h, residual, self.self_attn.qkv_proj)
        return (*self.self_attn.project(positions, h), residual)

    def after_attention(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense work after attention: attn [T, Hq * D] → as forward returns."""
        return self._mlp_block(self._reduce(linear(self.self_attn.o_proj, attn)), residual)

    def _mlp_block(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual, h_int8 = _norm(self.post_attention_layernorm, h, residual, self.mlp.gate_up_proj)
        return self._reduce(self.mlp(h, h_int8)), residual

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp_size == 1 else reduce_partial(partial)


def _norm(
    norm: RMSNorm,
    h: torch.Tensor,
    residual: torch.Tensor | None,
    consumer: Layer,
) -> tuple[torch.Tensor, torch.Tensor, Int8Row | None]:
    """(norm(h (+ residual)), the residual stream, and the norm rounded to int8 where the layer
    it feeds reads it so)."""
    if reads_int8(consumer, h):
        return norm.forward_int8(h, residual)
    if residual is None:
        return norm(h), h, None
    h, residual = norm.add_forward(h, residual)
    return h, residual, None


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rope
        # _weight skips the random init: on the meta device it would import torch._dynamo (~3 s)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.tp_driver: StepSender | None = None
        self.tp: TPShard | None = None  # this rank's share, when the model is split over ranks
        self._cpu_plan: list[CpuDecodeLayers | None] | None = None

    if TYPE_CHECKING:  # nn.Module.__call__ runs forward (with hooks); torch types it as returning Any

        def __call__(self, fb: ForwardBatch) -> torch.Tensor: ...

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after to_empty/to, which break ties); a
        quantized embedding is tied when it is installed."""
        if self.config.tie_word_embeddings and isinstance(self.model.embed_tokens, nn.Embedding):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits (float32) for the rows fb.logits_indices of the step's tokens."""
        if self.tp_driver is not None:  # tensor parallel rank 0: the other ranks run this step too
            self.tp_driver.send_step(fb, logits=True)
        return self._logits(self._hidden_states(fb), fb)

    def logits_after_layers(self, h: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """forward's result from the last layer's output and residual stream (all T rows)."""
        return self._logits(self._final_norm(h, residual, fb), fb)

    def _logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        logits = linear(self.lm_head, hidden)
        if self.tp is not None:
            return gather_logits(logits.float(), self.tp)
        return logits.float() if fb.logits_out is None else fb.logits_out.copy_(logits)

    @torch.inference_mode()
    def hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        """The final normalized hidden states (model dtype) of the rows fb.logits_indices."""
        if self.tp_driver is not None:
            self.tp_driver.send_step(fb, logits=False)
        return self._hidden_states(fb)

    def _hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        embed = self.model.embed_tokens
        h = embed(fb.input_ids) if self.tp is None else embed_rows(embed, fb.input_ids, self.tp)
        residual = None
        with self.model.rotary.step(fb.positions):  # cos/sin gathered once for all layers
            cpu_layers = self._cpu_layers()
            if cpu_layers is not None and cpu_layers.accepts(fb, h):
                h, residual = cpu_layers.run(fb, h)
            else:
                for layer in self.model.layers:
                    h, residual = layer(fb.positions, h, residual, fb)
        assert residual is not None
        return self._final_norm(h, residual, fb)

    def _final_norm(self, h: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        rows = fb.logits_indices
        return self.model.norm.add_forward(h[rows], residual[rows])[0]

    def _cpu_layers(self) -> CpuDecodeLayers | None:
        """The one-call layer loop for small CPU steps (models/cpu_layers.py: one request's few
        tokens, or a decode step of a few requests), built on first use: weights are final by
        then (loaded, quantized blocks installed)."""
        if self._cpu_plan is None:
            layers = [m for m in self.model.layers if isinstance(m, LlamaDecoderLayer)]
            whole = self.tp is None and len(layers) == len(self.model.layers)
            self._cpu_plan = [CpuDecodeLayers.build(layers, self.model.rotary) if whole else None]
        return self._cpu_plan[0]

    def _stacked(self) -> dict[str, tuple[str, int, int]]:
        """HF weight name part → (our fused parameter's name part, row offset, rows)."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        return {
            "self_attn.q_proj.": ("self_attn.qkv_proj.", 0, q),
            "self_attn.k_proj.": ("self_attn.qkv_proj.", q, kv),
            "self_attn.v_proj.": ("self_attn.qkv_proj.", q + kv, kv),
            "mlp.gate_proj.": ("mlp.gate_up_proj.", 0, inter),
            "mlp.up_proj.": ("mlp.gate_up_proj.", inter, inter),
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]]) -> None:
        """Copy named HF weights in (q/k/v and gate/up into their fused parameters' rows); every
        parameter row must be covered exactly once. GGUF blocks (QuantTensor) replace their
        layer with a QuantLinear / QuantEmbedding once all its rows are in."""
        params = dict(self.named_parameters())
        stacked = self._stacked()
        covered: dict[str, int] = {}
        quantized: dict[str, list[tuple[int, QuantTensor]]] = {}
        for name, w in weights:
            if "rotary_emb" in name:
                continue
            target, offset, rows = name, 0, None
            for part, (fused, off, n) in stacked.items():
                if part in name:
                    target, offset, rows = name.replace(part, fused), off, n
                    break
            if target not in params:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(f"checkpoint has a weight the model does not: {name}")
            p = params[target]
            dst = p if rows is None else p[offset : offset + rows]
            if tuple(dst.shape) != tuple(w.shape):
                raise ValueError(
                    f"shape mismatch for {name}: model {tuple(dst.shape)} vs checkpoint {tuple(w.shape)}"
                )
            if isinstance(w, QuantTensor):
                quantized.setdefault(target.removesuffix(".weight"), []).append((offset, w))
            else:
                with torch.no_grad():
                    dst.copy_(w.to(p.dtype))
            covered[target] = covered.get(target, 0) + _rows(dst)
        missing = {n for n, p in params.items() if covered.get(n, 0) != _rows(p)}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
        install_quantized(self, quantized, self.config.tie_word_embeddings)


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """model.to(dtype).to_empty(device) for a model built on the meta device: uninitialized
    floating parameters in dtype on device. Done with torch.empty: the meta path of to_empty
    goes through torch._refs, whose first use imports sympy (about 1 s of start-up)."""
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                t = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device=device)
                mod._parameters[name] = nn.Parameter(t, requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = torch.empty(
                    b.shape, dtype=dtype if b.is_floating_point() else b.dtype, device=device
                )
    return model


def _rows(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1
