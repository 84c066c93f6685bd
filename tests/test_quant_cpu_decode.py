"""radixlm.kernels.cpu_decode, the C pieces of one-request CPU decode, against the torch ops they
replace: add + RMSNorm, and rope + KV store + attention of one token over its request's slots
(GQA, slots out of order, the new token's slot among them); and of a few tokens (a verify step)
against the torch extend path, each row bitwise equal to the decode call that token would get."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.backend.models.rotary import RotaryEmbedding
from radixlm.kernels import cpu_decode

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler or no AVX2 here")


def test_add_rmsnorm_matches_torch() -> None:
    x, residual, w = torch.randn(1, 576), torch.randn(1, 576), torch.randn(576)
    h, total = cpu_decode.add_rmsnorm(x, residual, w, 1e-5)
    ref_total = x + residual
    torch.testing.assert_close(total, ref_total)
    torch.testing.assert_close(h, F.rms_norm(ref_total, (576,), w, 1e-5), rtol=1e-5, atol=1e-6)


def test_add_rmsnorm_rows_equal_one_row_calls() -> None:
    x, residual, w = torch.randn(5, 576), torch.randn(5, 576), torch.randn(576)
    h, total = cpu_decode.add_rmsnorm(x, residual, w, 1e-5)
    for i in range(5):
        h1, t1 = cpu_decode.add_rmsnorm(x[i : i + 1], residual[i : i + 1], w, 1e-5)
        assert torch.equal(h[i : i + 1], h1) and torch.equal(total[i : i + 1], t1)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rope_store_attend_matches_torch(hq: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(hq * d)
    rope = RotaryEmbedding(d, 64, 10000.0, None)
    rope.build("cpu")
    k_buf, v_buf = torch.randn(20, hkv, d, generator=g), torch.randn(20, hkv, d, generator=g)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    slots = torch.tensor([4, 17, 2, 9, 11])  # the new token's slot last, as the table holds it
    qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=g)
    pos = torch.tensor([37])
    cos, sin_signed = rope.rows(pos)
    out = cpu_decode.rope_store_attend(qkv, (hq, hkv, d), cos, sin_signed, k_buf, v_buf, slots[-1:], slots)

    q, k, v = qkv.view(hq + 2 * hkv, d).split([hq, hkv, hkv])
    q, k = rope(pos, q.unsqueeze(0), k.unsqueeze(0))
    k_before[11], v_before[11] = k[0], v
    torch.testing.assert_close(k_buf, k_before, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_buf, v_before)
    kb, vb = k_before[slots].transpose(0, 1)[None], v_before[slots].transpose(0, 1)[None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kb, vb, enable_gqa=True)
    torch.testing.assert_close(out, ref.reshape(1, hq * d), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128)])
def test_verify_rows_equal_torch_extend_and_decode_calls(hq: int, hkv: int, d: int) -> None:
    """Five new tokens after a prefix of 4: the torch extend path's causal attention, and each
    row exactly what a one-token call gives once the tokens before it are stored."""
    from radixlm.backend.attention import TorchAttentionBackend

    g = torch.Generator().manual_seed(hq + d)
    rope = RotaryEmbedding(d, 64, 10000.0, None)
    rope.build("cpu")
    k_buf, v_buf = torch.randn(20, hkv, d, generator=g), torch.randn(20, hkv, d, generator=g)
    k_ref, v_ref, k_one, v_one = k_buf.clone(), v_buf.clone(), k_buf.clone(), v_buf.clone()
    slots = torch.tensor([4, 17, 2, 9, 11, 0, 13, 6, 19])
    new, n = slots[4:], 5
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    pos = torch.arange(4, 9)
    cos, sin_signed = rope.rows(pos)
    out = cpu_decode.rope_store_attend(qkv, (hq, hkv, d), cos, sin_signed, k_buf, v_buf, new, slots)

    class Fb:  # the fields the torch extend path reads
        req_pool_indices_cpu = [0]
        extend_start_loc_cpu, extend_lens_cpu, seq_lens_cpu, prefix_lens_cpu = [0], [n], [9], [4]
        req_to_token = slots.unsqueeze(0)

    q, k, v = qkv.view(n, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    q, k = rope(pos, q, k)
    k_ref[new], v_ref[new] = k, v
    ref = TorchAttentionBackend()._extend(q, k_ref, v_ref, Fb).reshape(n, hq * d)  # type: ignore[arg-type]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_buf, k_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v_buf, v_ref)
    for i in range(n):
        one = cpu_decode.rope_store_attend(
            qkv[i : i + 1], (hq, hkv, d), cos[i : i + 1], sin_signed[i : i + 1], k_one, v_one,
            new[i : i + 1], slots[: 5 + i],
        )  # fmt: skip
        assert torch.equal(one, out[i : i + 1])
    assert torch.equal(k_one, k_buf) and torch.equal(v_one, v_buf)
