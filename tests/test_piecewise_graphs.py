"""CPU tests of backend/piecewise_graphs.py: token buckets, memory estimate, and the whole
capture/replay flow on a tiny random model with test_cuda_graph's stand-in capture (replay re-runs
the piece over the static buffers, which is what a CUDA graph does): extend and mixed steps through
the pieces give the eager forward's logits and KV (an fp8 pool's too), padding rows write no KV
slot, steps past the largest bucket stay eager, and a failed capture leaves extend steps eager.
Real CUDA capture: test_piecewise_graphs_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch
from test_cuda_graph import TINY, eager_capture

from radixlm.backend.model_config import ModelConfig
from radixlm.backend.model_runner import ModelRunner, ScheduledItem
from radixlm.backend.piecewise_graphs import (
    PiecewiseGraphs,
    activation_bytes_per_token,
    decoder_layers,
    token_buckets,
)


# ---- helpers (also used by test_piecewise_graphs_gpu.py) ------------------------------------
def piecewise_vs_eager(
    runner: ModelRunner,
    pieces: PiecewiseGraphs,
    steps: list[tuple[int, int]],
    seed: int = 0,
    kv_tolerance: float = 1e-3,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Requests of (cached, new) tokens: the cached ones prefilled eagerly, then one step of every
    request's new tokens (logits of each item's last token; all of a one-token item's) run once
    by the eager model and once, from the same KV, through the pieces. Asserts both wrote the same
    K/V (within kv_tolerance, relative and absolute) and nothing outside the step's slots.
    Returns (piecewise logits, eager logits, bucket)."""
    gen = torch.Generator().manual_seed(seed)
    vocab, dev = runner.config.vocab_size, runner.device
    rows, slots, prefill, items = [], [], [], []
    for cached, new in steps:
        row, s = runner.req_table.alloc(), runner.allocator.alloc(cached + new)
        assert row is not None and s is not None
        runner.req_table.write(row, 0, s)
        ids = torch.randint(0, vocab, (cached + new,), generator=gen).tolist()
        rows.append(row)
        slots.append(s)
        if cached:
            prefill.append(ScheduledItem(row, ids[:cached], 0, [cached - 1]))
        items.append(ScheduledItem(row, ids[cached:], cached, [new - 1]))
    try:
        if prefill:
            runner.model(
                runner.build_batch(prefill, torch.cat([s[:c] for s, (c, _) in zip(slots, steps)]).to(dev))
            )
        loc = torch.cat([s[c:] for s, (c, _) in zip(slots, steps)]).to(dev)
        pool = runner.kv_pool
        before = [b.clone() for b in (*pool.k_buffers, *pool.v_buffers)]
        eager = runner.model(runner.build_batch(items, loc, keep_extend=True)).clone()
        after_eager = [b.clone() for b in (*pool.k_buffers, *pool.v_buffers)]
        for buf, saved in zip((*pool.k_buffers, *pool.v_buffers), before):
            buf.copy_(saved)
        fb = runner.build_batch(items, loc, keep_extend=True)
        assert pieces.can_run(fb)
        hits = dict(pieces.bucket_hits)
        got = pieces.forward(fb)
        (bucket,) = [t for t, n in pieces.bucket_hits.items() if n != hits.get(t, 0)]
        step_slots = set(loc.tolist())
        for buf, then, want in zip((*pool.k_buffers, *pool.v_buffers), before, after_eager):
            buf, then, want = (x.float() for x in (buf, then, want))  # fp8 pools compare as floats
            moved = set(torch.nonzero((buf != then).flatten(1).any(1)).flatten().tolist())
            assert moved <= step_slots  # padding rows never reach the pool
            torch.testing.assert_close(buf, want, rtol=kv_tolerance, atol=kv_tolerance)
        return got, eager, bucket
    finally:
        for row, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_table.free(row)


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg = ModelConfig.from_hf_dict(TINY)
    return ModelRunner(
        cfg, None, torch.device("cpu"), torch.float32, 1024, 0.9, 16, random_weights=True, seed=3
    )


@pytest.fixture()
def pieces(runner):
    pw = PiecewiseGraphs(runner.graph_target(), runner.model, 100, eager_capture)
    assert pw.capture_all() and pw.enabled
    yield pw
    pw.disable()


# ---- pure host logic -------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 16, 17, 100, 1024, 1500])
def test_token_buckets_cover_every_step(max_tokens):
    sizes = token_buckets(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    for n in range(64, max_tokens + 1):
        bucket = min(s for s in sizes if s >= n)
        assert 3 * (bucket - n) <= bucket  # from 64 tokens up, at most a third of the rows pad
    with pytest.raises(ValueError, match=">= 1"):
        token_buckets(0)


def test_token_buckets_default_list():
    assert token_buckets(1024) == [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]


def test_activation_estimate_covers_the_mlp():
    cfg = ModelConfig.from_hf_dict({**TINY, "hidden_size": 4096, "intermediate_size": 14336})
    with torch.device("meta"):
        from radixlm.backend.models.llama import LlamaDecoderLayer
        from radixlm.backend.models.rotary import RotaryEmbedding

        layer = LlamaDecoderLayer(cfg, 0, RotaryEmbedding(cfg.head_dim, 16, 1e4, None))
    est = activation_bytes_per_token(layer, cfg.hidden_size, torch.bfloat16)
    assert est >= 2 * (2 * 14336 + 14336 + 4096)  # gate/up, their product, the output


# ---- capture / replay on the tiny model -------------------------------------------------------
def test_every_bucket_has_a_piece_per_layer_and_one_more(runner):
    seen: list[tuple[int, int]] = []

    def capture(fn):
        seen.append(fn.args)
        return eager_capture(fn)

    pw = PiecewiseGraphs(runner.graph_target(), runner.model, 40, capture)
    try:
        assert pw.capture_all() and pw.sizes == [16, 32, 40]
        layers = len(decoder_layers(runner.model))
        assert seen == [(i, t) for t in (40, 32, 16) for i in range(layers + 1)]  # largest first
        assert {t: len(g) for t, g in pw.graphs.items()} == {40: layers + 1, 32: layers + 1, 16: layers + 1}
    finally:
        pw.disable()


@pytest.mark.parametrize(
    "steps",
    [
        [(0, 37)],  # one fresh prompt, padded 37 -> 64
        [(12, 9), (0, 30), (5, 1)],  # chunks behind cached prefixes and a decode row, padded to 64
        [(3, 1)] * 6 + [(20, 16)],  # a mixed step: decode rows first, then a prompt chunk
    ],
)
def test_a_step_through_the_pieces_matches_the_eager_forward(runner, pieces, steps):
    got, eager, bucket = piecewise_vs_eager(runner, pieces, steps)
    assert bucket == min(s for s in pieces.sizes if s >= sum(n for _, n in steps))
    assert got.shape == eager.shape == (len(steps), runner.config.vocab_size)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(8))
def test_random_steps_through_the_pieces_match_the_eager_forward(runner, pieces, seed):
    """Random mixes of decode rows, fresh prompts and chunks behind cached prefixes, any size up to
    the largest bucket, in any order."""
    rng = torch.Generator().manual_seed(100 + seed)
    steps: list[tuple[int, int]] = []
    room = int(torch.randint(1, 101, (1,), generator=rng))
    while room > 0 and len(steps) < 8:
        new = min(room, int(torch.randint(1, 40, (1,), generator=rng)))
        steps.append((int(torch.randint(0, 50, (1,), generator=rng)), new))
        room -= new
    got, eager, bucket = piecewise_vs_eager(runner, pieces, steps, seed=seed)
    assert bucket == min(s for s in pieces.sizes if s >= sum(n for _, n in steps))
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_an_fp8_pool_step_through_the_pieces_matches_the_eager_forward():
    """The pieces hand attention k/v in the model dtype; the fp8 pool quantizes them on store."""
    cfg = ModelConfig.from_hf_dict(TINY)
    fp8 = ModelRunner(
        cfg,
        None,
        torch.device("cpu"),
        torch.float32,
        512,
        0.9,
        16,
        random_weights=True,
        seed=3,
        kv_cache_dtype="fp8_e4m3",
    )
    assert fp8.kv_pool.quantized
    pw = PiecewiseGraphs(fp8.graph_target(), fp8.model, 64, eager_capture)
    assert pw.capture_all()
    got, eager, _ = piecewise_vs_eager(fp8, pw, [(12, 9), (0, 30), (5, 1)])
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_stale_rows_from_a_larger_step_do_not_change_a_smaller_one(runner, pieces):
    """The buffers keep the last step's rows past this step's tokens: they are padding only."""
    first, _, _ = piecewise_vs_eager(runner, pieces, [(0, 60)], seed=1)
    got, eager, bucket = piecewise_vs_eager(runner, pieces, [(4, 33)], seed=2)
    assert bucket == 64 and first.shape == got.shape
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_the_runner_routes_steps_by_size(runner, pieces):
    """ModelRunner.forward takes the pieces for a step up to the largest bucket, eager past it."""
    runner.piecewise = pieces
    try:
        row, s = runner.req_table.alloc(), runner.allocator.alloc(101)
        assert row is not None and s is not None
        runner.req_table.write(row, 0, s)
        for n, through_pieces in ((100, True), (101, False)):
            hits = sum(pieces.bucket_hits.values())
            fb = runner.build_batch([ScheduledItem(row, [i % 97 for i in range(n)], 0, [n - 1])], s[:n])
            assert pieces.can_run(fb) is through_pieces
            runner.forward(fb)
            assert sum(pieces.bucket_hits.values()) == hits + through_pieces
        runner.allocator.free(s)
        runner.req_table.free(row)
    finally:
        runner.piecewise = None


def test_a_failed_capture_leaves_extend_steps_eager(runner, caplog):
    calls = []

    def failing(fn):
        calls.append(fn.args)
        if len(calls) == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        return eager_capture(fn)

    pw = PiecewiseGraphs(runner.graph_target(), runner.model, 32, failing)
    with caplog.at_level(logging.WARNING, logger="radixlm.backend.piecewise_graphs"):
        assert not pw.capture_all()
    assert not pw.enabled and not pw.graphs
    assert "failed at 32 tokens" in caplog.text and "not permitted" in caplog.text
    fb = runner.build_batch([ScheduledItem(0, [1, 2, 3], 0, [2])], torch.tensor([5, 6, 7]))
    assert not pw.can_run(fb)
    with pytest.raises(ValueError, match="no piecewise graphs"):
        pw.forward(fb)
