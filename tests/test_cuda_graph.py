"""CPU tests of backend/cuda_graph_runner.py: bucket sizes, memory fitting, static-input padding,
the graph-vs-eager decision, and the whole capture/replay flow on a tiny random model with a
stand-in capture (replay re-runs the forward over the static buffers into the captured output
tensor, which is what a CUDA graph does). CUDA capture itself is in test_cuda_graph_gpu.py."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixlm.backend import model_runner as model_runner_module
from radixlm.backend.cascade_groups import make_cascade_plan
from radixlm.backend.cuda_graph_runner import (
    CAPTURE_RESERVE_BYTES,
    CudaGraphRunner,
    StaticDecodeInputs,
    activation_bytes_per_row,
    bucket_for,
    capture_batch_sizes,
    fit_max_bs,
    fit_to_free_memory,
)
from radixlm.backend.forward_batch import ForwardBatch
from radixlm.backend.model_config import ModelConfig
from radixlm.backend.model_runner import ModelRunner, ScheduledItem, _extra_row_reads, decode_rows

TINY = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


# ---- helpers (also used by test_cuda_graph_gpu.py) ------------------------------------------
def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Graph semantics without CUDA: the output tensor is fixed at capture; replay recomputes
    from whatever the static inputs hold now and writes into it."""
    out = fn()

    def replay() -> None:
        out.copy_(fn())

    return replay, out


def decode_batch(
    runner: ModelRunner, lens: list[int], seed: int = 0
) -> tuple[ForwardBatch, Callable[[], None]]:
    """Prefill len random tokens per request (eagerly, through the real KV pool), then build the
    decode batch of one more token each. Returns (batch, release) — release frees rows and slots."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    rows, slots, prefill, decode = [], [], [], []
    for n in lens:
        row, s = runner.req_table.alloc(), runner.allocator.alloc(n + 1)
        assert row is not None and s is not None
        runner.req_table.write(row, 0, s)
        ids = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
        rows.append(row)
        slots.append(s)
        prefill.append(ScheduledItem(row, ids[:n], 0, [n - 1]))
        decode.append(ScheduledItem(row, ids[n:], n, [0]))
    runner.model(runner.build_batch(prefill, torch.cat([s[:-1] for s in slots])))
    fb = runner.build_batch(decode, torch.cat([s[-1:] for s in slots]))

    def release() -> None:
        for row, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_table.free(row)

    return fb, release


def changed_kv_slots(runner: ModelRunner, before: list[torch.Tensor]) -> set[int]:
    """KV slots whose K rows (any layer) differ from the snapshot `before`."""
    changed: set[int] = set()
    for k_now, k_then in zip(runner.kv_pool.k_buffers, before):
        diff = (k_now != k_then).flatten(1).any(1)
        changed |= set(torch.nonzero(diff).flatten().tolist())
    return changed


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    cfg = ModelConfig.from_hf_dict(TINY)
    return ModelRunner(
        cfg, None, torch.device("cpu"), torch.float32, 512, 0.9, 16, random_weights=True, seed=1
    )


@pytest.fixture()
def graphs(runner):
    gr = CudaGraphRunner(runner.graph_target(), 8, eager_capture)
    assert gr.capture_all()
    runner.graph_runner = gr
    yield gr
    runner.graph_runner = None
    gr.disable()


# ---- pure host logic -------------------------------------------------------------------------
@pytest.mark.parametrize("max_bs", [1, 2, 3, 8, 10, 17, 160])
def test_bucket_sizes_cover_every_batch(max_bs):
    sizes = capture_batch_sizes(max_bs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_bs
    for bs in range(1, max_bs + 1):
        naive = min(s for s in sizes if s >= bs)
        assert bucket_for(bs, sizes) == naive
        assert naive - bs < 8  # padding never wastes a whole step of 8 rows
    assert bucket_for(max_bs + 1, sizes) is None
    assert bucket_for(0, sizes) is None


def test_bucket_sizes_default_list():
    sizes = capture_batch_sizes(160)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-2:] == [152, 160] and len(sizes) == 23
    with pytest.raises(ValueError, match="at least 1"):
        capture_batch_sizes(0)


def test_fit_max_bs():
    assert fit_max_bs(160, 1000, 10**9, reserve_bytes=0) == 160
    # room for exactly 5 doubled rows
    assert fit_max_bs(160, 1000, 10_000 + 500, reserve_bytes=500) == 5
    assert fit_max_bs(160, 1000, 1999, reserve_bytes=0) == 0
    assert fit_max_bs(160, 1000, 100, reserve_bytes=500) == 0


def test_fit_to_free_memory_logs_a_cut(monkeypatch, caplog):
    free = CAPTURE_RESERVE_BYTES + 10 * 2 * 1000  # room for ten doubled units
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    dev = torch.device("cuda")
    assert fit_to_free_memory(dev, 8, 1000, "graphs: max things") == 8
    assert "graphs: max things" not in caplog.text
    assert fit_to_free_memory(dev, 64, 1000, "graphs: max things") == 10
    assert f"graphs: max things 64 -> 10 to fit in {free} free bytes" in caplog.text


def test_activation_estimate_covers_the_logits():
    cfg = ModelConfig.from_hf_dict(TINY)
    est = activation_bytes_per_row(cfg, torch.bfloat16, 4)
    assert est >= cfg.vocab_size * (2 + 4 + 4)  # bf16 logits, their float32 copy, the clone
    assert activation_bytes_per_row(cfg, torch.bfloat16, 64) > est  # more splits, more state


# ---- static inputs ---------------------------------------------------------------------------
def test_static_inputs_pad_and_reset_stale_rows(runner):
    inp = StaticDecodeInputs(8, pad_row=5, device=torch.device("cpu"), vocab_size=97)
    assert inp.req_pool_indices.tolist() == [5] * 8 and inp.seq_lens.tolist() == [1] * 8
    ptrs = [t.data_ptr() for t in (inp.input_ids, inp.out_cache_loc, inp.seq_lens)]
    fb7, rel7 = decode_batch(runner, [3, 4, 5, 6, 7, 8, 9])
    try:
        inp.load(fb7)
        assert inp.out_cache_loc[:7].tolist() == fb7.out_cache_loc.tolist()
        assert inp.seq_lens[:7].tolist() == fb7.seq_lens_cpu and inp.seq_lens[7] == 1
        assert inp.input_ids[:7].tolist() == fb7.input_ids.tolist()
        assert inp.positions[:7].tolist() == [3, 4, 5, 6, 7, 8, 9]
    finally:
        rel7()
    fb2, rel2 = decode_batch(runner, [11, 2])
    try:
        inp.load(fb2)
        assert inp.req_pool_indices.tolist() == fb2.req_pool_indices_cpu + [5] * 6
        assert inp.out_cache_loc[2:].tolist() == [0] * 6  # no padding row writes a live slot
        assert inp.seq_lens.tolist() == [12, 3] + [1] * 6
        assert inp.positions[2:].tolist() == [0] * 6 and inp.input_ids[2:].tolist() == [0] * 6
        assert inp.prefix_lens.tolist() == [11, 2] + [0] * 6
    finally:
        rel2()
    assert ptrs == [t.data_ptr() for t in (inp.input_ids, inp.out_cache_loc, inp.seq_lens)]
    with pytest.raises(ValueError, match="exceeds"):
        big, rel = decode_batch(runner, [1] * 9)
        try:
            inp.load(big)
        finally:
            rel()


# ---- capture / replay on the tiny model -------------------------------------------------------
def test_captured_batches_are_static_decode_batches(runner):
    seen: list[ForwardBatch] = []
    gr = CudaGraphRunner(
        runner.graph_target(), 10, lambda fn: (seen.append(fn.args[0]), eager_capture(fn))[1]
    )
    try:
        assert gr.capture_all() and gr.enabled
        assert [fb.batch_size for fb in seen] == [10, 8, 4, 2, 1]  # largest first
        for fb in seen:
            assert fb.is_decode and fb.decode_num_splits is not None and fb.decode_num_splits >= 1
            assert fb.input_ids.data_ptr() == gr.inputs.input_ids.data_ptr()  # views, not copies
            assert fb.req_to_token is runner.req_table.table and fb.kv_pool is runner.kv_pool
        # every graph writes its logits into the runner's one buffer: none holds memory of its own
        assert {g.out.data_ptr() for g in gr.graphs.values()} == {gr.inputs.logits.data_ptr()}
        assert [g.out.shape[0] for g in gr.graphs.values()] == [10, 8, 4, 2, 1]
    finally:
        gr.disable()


@pytest.mark.parametrize("lens", [[7], [3, 9, 1], [5, 2, 8, 4, 6], [2, 3, 4, 5, 6, 7, 8, 9]])
def test_replay_matches_eager_and_writes_only_its_slots(runner, graphs, lens):
    fb, release = decode_batch(runner, lens, seed=len(lens))
    try:
        eager = runner.model(fb)
        before = [k.clone() for k in runner.kv_pool.k_buffers]
        got = runner.forward(fb)
        assert got.shape == eager.shape == (len(lens), runner.config.vocab_size)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        allowed = {0, *fb.out_cache_loc.tolist()}
        assert changed_kv_slots(runner, before) <= allowed
        assert graphs.bucket_hits[bucket_for(len(lens), graphs.sizes)] == 1
    finally:
        release()


def test_replay_after_a_larger_batch_leaves_its_slots_alone(runner, graphs):
    big, rel_big = decode_batch(runner, [4, 5, 6, 7, 8, 9, 10], seed=3)
    small, rel_small = decode_batch(runner, [6, 3, 5], seed=4)
    try:
        runner.forward(big)  # bucket 8: static rows 0..6 now hold big's slots
        for k in runner.kv_pool.k_buffers:  # mark big's new slots; stale rows would overwrite them
            k[big.out_cache_loc] = 7.0
        before = [k.clone() for k in runner.kv_pool.k_buffers]
        got = runner.forward(small)  # bucket 4
        assert changed_kv_slots(runner, before) <= {0, *small.out_cache_loc.tolist()}
        torch.testing.assert_close(got, runner.model(small), rtol=1e-4, atol=1e-4)
        assert graphs.bucket_hits == {8: 1, 4: 1}
    finally:
        rel_big()
        rel_small()


def test_decision_eager_vs_graph(runner, graphs):
    fb, release = decode_batch(runner, [4, 6])
    try:
        assert graphs.can_run(fb)
        fb.cascade_plan = make_cascade_plan([1, 1], [0, 0], fb.seq_lens_cpu, "cpu")
        assert not graphs.can_run(fb)  # no cascade graphs were captured
        fb.cascade_plan = None
        fb.attn_backend = object()  # e.g. a test swapping in the torch reference backend
        assert not graphs.can_run(fb)
        fb.attn_backend = runner.attn_backend
        graphs.enabled = False
        assert not graphs.can_run(fb)
        graphs.enabled = True
    finally:
        release()
    too_big, rel_big = decode_batch(runner, [2] * 9)
    row, slots = runner.req_table.alloc(), runner.allocator.alloc(9)
    runner.req_table.write(row, 0, slots)
    try:
        assert not graphs.can_run(too_big)
        # more new tokens than the largest graph has rows: an eager extend
        extend = runner.build_batch([ScheduledItem(row, list(range(1, 10)), 0, [8])], slots)
        assert not extend.is_decode and not graphs.can_run(extend)
        runner.forward(extend)
        runner.forward(too_big)
        assert sum(graphs.bucket_hits.values()) == 0  # both ran eagerly
    finally:
        rel_big()
        runner.allocator.free(slots)
        runner.req_table.free(row)


def test_decode_rows_are_the_items_tokens_one_per_row():
    items = [
        ScheduledItem(3, [10, 11, 12], 5, [0, 1, 2]),
        ScheduledItem(4, [20], 9, [0]),
        ScheduledItem(6, [30, 31], 2, [1]),
    ]
    rows = decode_rows(items)
    assert [(r.req_pool_idx, r.token_ids, r.start, r.logit_offsets) for r in rows] == [
        (3, [10], 5, [0]),
        (3, [11], 6, [0]),
        (3, [12], 7, [0]),
        (4, [20], 9, [0]),
        (6, [30], 2, []),
        (6, [31], 3, [0]),
    ]


def verify_rows_vs_extend(runner: ModelRunner, graphs: CudaGraphRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify-shaped step (a request's token and 3 drafts, all returning logits), a forced-token
    run returning only its last logit, and a plain decode, built twice: without graphs (an eager
    extend) and with them (decode rows through a graph, bucket 8). Returns (graph, eager) logits;
    asserts the graph ran and wrote only the step's slots (and the padding slot 0)."""
    base, rel_base = decode_batch(runner, [6, 4, 5], seed=9)  # prefilled requests; reuse their rows
    gen = torch.Generator().manual_seed(2)
    new_slots = [runner.allocator.alloc(n) for n in (4, 3, 1)]
    items = []
    for row, start, n, offsets, slots in zip(
        base.req_pool_indices_cpu, base.seq_lens_cpu, (4, 3, 1), ([0, 1, 2, 3], [2], [0]), new_slots
    ):
        assert slots is not None
        runner.req_table.write(row, start - 1, slots)  # from the decode token's slot on
        ids = torch.randint(0, runner.config.vocab_size, (n,), generator=gen).tolist()
        items.append(ScheduledItem(row, ids, start - 1, offsets))
    loc = torch.cat(new_slots).to(runner.device)  # type: ignore[arg-type]
    try:
        runner.graph_runner = None
        eager_fb = runner.build_batch(items, loc)
        assert not eager_fb.is_decode
        eager = runner.forward(eager_fb).clone()
        runner.graph_runner = graphs
        before = [k.clone() for k in runner.kv_pool.k_buffers]
        hits = graphs.bucket_hits[8]
        fb = runner.build_batch(items, loc)
        assert fb.is_decode and fb.batch_size == 8 and fb.seq_lens_cpu[:4] == [7, 8, 9, 10]
        got = runner.forward(fb)
        assert graphs.bucket_hits[8] == hits + 1
        assert got.shape == eager.shape == (6, runner.config.vocab_size)
        assert changed_kv_slots(runner, before) <= {0, *loc.tolist()}
    finally:
        runner.graph_runner = graphs
        for s in new_slots:
            runner.allocator.free(s)  # type: ignore[arg-type]
        rel_base()
    return got, eager


def test_verify_and_forced_tokens_run_as_decode_rows_in_a_graph(runner, graphs):
    got, eager = verify_rows_vs_extend(runner, graphs)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("start,n", [(0, 1), (0, 2), (0, 20), (7, 1), (7, 5), (100, 33)])
def test_extra_row_reads_count_what_rows_read_beyond_one_pass(start, n):
    rows_read = sum(start + j + 1 for j in range(n))  # row j attends to its first start + j + 1 slots
    assert _extra_row_reads([ScheduledItem(0, [1] * n, start, [])]) == rows_read - (start + n)


def fresh_prompt_graph_vs_eager(
    runner: ModelRunner, graphs: CudaGraphRunner, n: int
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One fresh prompt of n tokens (more than DECODE_ROWS_MAX_PER_ITEM), its last logit, run
    eagerly and then with the graphs: (graph-path logits, eager logits, whether a graph ran)."""
    row, slots = runner.req_table.alloc(), runner.allocator.alloc(n)
    assert row is not None and slots is not None
    runner.req_table.write(row, 0, slots)
    ids = torch.randint(
        0, runner.config.vocab_size, (n,), generator=torch.Generator().manual_seed(5)
    ).tolist()
    items = [ScheduledItem(row, ids, 0, [n - 1])]
    loc = slots.to(runner.device)
    try:
        runner.graph_runner = None
        eager = runner.forward(runner.build_batch(items, loc)).clone()
        runner.graph_runner = graphs
        hits = sum(graphs.bucket_hits.values())
        got = runner.forward(runner.build_batch(items, loc))
        return got, eager, sum(graphs.bucket_hits.values()) == hits + 1
    finally:
        runner.graph_runner = graphs
        runner.allocator.free(slots)
        runner.req_table.free(row)


def test_a_short_fresh_prompt_runs_as_decode_rows_in_a_graph(runner, monkeypatch):
    gr = CudaGraphRunner(runner.graph_target(), 32, eager_capture)
    assert gr.capture_all()
    try:
        got, eager, graphed = fresh_prompt_graph_vs_eager(runner, gr, 20)
        assert graphed and got.shape == eager.shape == (1, runner.config.vocab_size)
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        # past the extra-read bound (20 tokens: 190 extra rows of 128 bytes) it stays an extend
        monkeypatch.setattr(model_runner_module, "DECODE_ROWS_MAX_EXTRA_KV_BYTES", 189 * 128)
        got, eager, graphed = fresh_prompt_graph_vs_eager(runner, gr, 20)
        assert not graphed
        torch.testing.assert_close(got, eager)
    finally:
        runner.graph_runner = None
        gr.disable()


def test_keep_extend_builds_the_items_as_given(runner, graphs):
    row, slots = runner.req_table.alloc(), runner.allocator.alloc(3)
    assert row is not None and slots is not None
    try:
        items = [ScheduledItem(row, [1, 2, 3], 0, [2])]
        assert runner.build_batch(items, slots).batch_size == 3  # decode rows, one per token
        kept = runner.build_batch(items, slots, keep_extend=True)
        assert not kept.is_decode and kept.batch_size == 1 and kept.extend_lens_cpu == [3]
    finally:
        runner.allocator.free(slots)
        runner.req_table.free(row)


def test_capture_failure_falls_back_to_eager(runner, caplog):
    free_rows = runner.req_table.available_size()
    calls = []

    def failing(fn):
        calls.append(fn)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return eager_capture(fn)

    gr = CudaGraphRunner(runner.graph_target(), 8, failing)
    assert runner.req_table.available_size() == free_rows - 1  # pad row reserved
    with caplog.at_level(logging.WARNING, logger="radixlm.backend.cuda_graph_runner"):
        assert not gr.capture_all()
    assert "capture failed at batch size 4" in caplog.text and "simulated" in caplog.text
    assert not gr.enabled and gr.graphs == {}
    assert runner.req_table.available_size() == free_rows  # pad row returned
    fb, release = decode_batch(runner, [3, 4])
    try:
        runner.graph_runner = gr
        assert not gr.can_run(fb)
        torch.testing.assert_close(runner.forward(fb), runner.model(fb))
        with pytest.raises(ValueError, match="no captured graph"):
            gr.replay(fb)
    finally:
        runner.graph_runner = None
        release()


def test_cpu_runner_never_builds_graphs(runner):
    assert runner.device.type == "cpu" and runner.graph_runner is None
    cfg = ModelConfig.from_hf_dict(TINY)
    other = ModelRunner(
        cfg,
        None,
        torch.device("cpu"),
        torch.float32,
        64,
        0.9,
        4,
        random_weights=True,
        disable_cuda_graph=False,
        cuda_graph_max_bs=4,
    )
    assert other.graph_runner is None


def test_engine_rejects_bad_max_bs():
    from radixlm.backend.engine import Engine

    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        Engine(device="cpu", model_shape="llama-3.2-1b", cuda_graph_max_bs=0)


# ---- the Triton decode path with the graphs' fixed split counts (TRITON_INTERPRET=1) ----------
def _interp_records() -> list[dict]:
    """Graph replay through TritonAttentionBackend (split count fixed per graph size for a 4096
    context: 32 splits over rows of 1-130 tokens) vs the eager Triton path (split count from
    the live lengths) and the torch reference backend. Runs in a subprocess under the interpreter."""
    from radixlm.backend.attention import TorchAttentionBackend
    from radixlm.backend.attention_triton import TritonAttentionBackend

    cfg = ModelConfig.from_hf_dict(
        {**TINY, "hidden_size": 64, "num_hidden_layers": 1, "max_position_embeddings": 4096}
    )
    runner = ModelRunner(
        cfg, None, torch.device("cpu"), torch.float32, 1024, 0.9, 8, random_weights=True, seed=2
    )
    runner.attn_backend = TritonAttentionBackend(num_sms=132)
    gr = CudaGraphRunner(runner.graph_target(), 4, eager_capture)
    assert gr.capture_all()
    runner.graph_runner = gr
    records = []
    for lens in ([3, 40, 130], [70, 1]):
        fb, release = decode_batch(runner, lens, seed=len(lens))
        try:
            eager = runner.model(fb)
            got = runner.forward(fb)
            fb.attn_backend = TorchAttentionBackend()
            ref = runner.model(fb)
            gbs = bucket_for(len(lens), gr.sizes)
            records.append(
                {
                    "lens": lens,
                    "splits": gr.graphs[gbs].fb.decode_num_splits,
                    "eager_splits": fb.decode_num_splits,
                    "hits": gr.bucket_hits[gbs],
                    "err_graph_ref": (got - ref).abs().max().item(),
                    "err_eager_ref": (eager - ref).abs().max().item(),
                }
            )
        finally:
            release()
    return records


def forked_decode_batch(
    runner: ModelRunner, docs: int, doc_len: int, forks: int, own: int, seed: int
) -> tuple[ForwardBatch, Callable[[], None]]:
    """docs documents of doc_len tokens prefilled once, forks requests per document whose
    req_to_token rows start with the document's slots, own more tokens each prefilled after it,
    then the decode batch of one more token each (requests of a document contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    rows, slots, decode = [], [], []

    def take(n: int) -> tuple[int, torch.Tensor]:
        row, s = runner.req_table.alloc(), runner.allocator.alloc(n)
        assert row is not None and s is not None
        rows.append(row)
        slots.append(s)
        return row, s

    for _ in range(docs):
        row, doc = take(doc_len)
        runner.req_table.write(row, 0, doc)
        ids = torch.randint(0, vocab, (doc_len,), generator=gen).tolist()
        runner.model(runner.build_batch([ScheduledItem(row, ids, 0, [doc_len - 1])], doc))
        for _ in range(forks):
            row, s = take(own + 1)
            runner.req_table.write(row, 0, doc)
            runner.req_table.write(row, doc_len, s)
            ids = torch.randint(0, vocab, (own + 1,), generator=gen).tolist()
            runner.model(runner.build_batch([ScheduledItem(row, ids[:own], doc_len, [own - 1])], s[:-1]))
            decode.append((ScheduledItem(row, ids[own:], doc_len + own, [0]), s[-1:]))
    fb = runner.build_batch([d[0] for d in decode], torch.cat([d[1] for d in decode]))

    def release() -> None:
        for row, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_table.free(row)

    return fb, release


def _interp_cascade_records() -> list[dict]:
    """Cascade decode through the Triton kernels (interpreted): each plan replayed through the
    cascade graph kind that holds it vs the eager cascade launch and the torch reference backend
    (which attends to each request's whole row). Runs in a subprocess under the interpreter."""
    from radixlm.backend.attention import TorchAttentionBackend
    from radixlm.backend.attention_triton import TritonAttentionBackend

    cfg = ModelConfig.from_hf_dict(
        {**TINY, "hidden_size": 64, "num_hidden_layers": 1, "max_position_embeddings": 512}
    )
    runner = ModelRunner(
        cfg, None, torch.device("cpu"), torch.float32, 2048, 0.9, 40, random_weights=True, seed=2
    )
    runner.attn_backend = TritonAttentionBackend(num_sms=8)
    gr = CudaGraphRunner(runner.graph_target(), 16, eager_capture, cascade=True)
    assert gr.capture_all()
    runner.graph_runner = gr
    records = []
    for docs, forks in ((1, 6), (6, 2)):
        fb, release = forked_decode_batch(runner, docs, 70, forks, 5, seed=docs)
        try:
            fb.cascade_plan = make_cascade_plan([forks] * docs, [70] * docs, fb.seq_lens_cpu, "cpu")
            eager = runner.model(fb)
            hits = [kind.hits for kind in gr.cascade]
            got = runner.forward(fb)
            fb.cascade_plan, fb.attn_backend = None, TorchAttentionBackend()
            ref = runner.model(fb)
            records.append(
                {
                    "docs": docs,
                    "hits": [kind.hits - h for kind, h in zip(gr.cascade, hits)],
                    "err_graph_ref": (got - ref).abs().max().item(),
                    "err_eager_ref": (eager - ref).abs().max().item(),
                }
            )
        finally:
            release()
    return records


@pytest.mark.slow
def test_triton_decode_with_fixed_graph_splits_interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(records) == 2
    for r in records:
        print(r)
        assert r["splits"] == 32 and r["eager_splits"] == 1 and r["hits"] == 1
        assert r["err_graph_ref"] < 1e-4 and r["err_eager_ref"] < 1e-4


@pytest.mark.slow
def test_cascade_graphs_interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "cascade"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["hits"] for r in records] == [[1, 0], [0, 1]]  # one group: few-groups kind; six: many
    for r in records:
        print(r)
        assert r["err_graph_ref"] < 1e-4 and r["err_eager_ref"] < 1e-4


if __name__ == "__main__":
    print(json.dumps(_interp_cascade_records() if sys.argv[1:] == ["cascade"] else _interp_records()))


def test_static_cascade_plan_pads_with_empty_groups():
    """A live plan of 3 groups over 6 requests, loaded into buffers for up to 8: the groups past
    it are empty ([6, 6)), unused shared-group slots name one of them, padding rows share nothing."""
    from radixlm.backend.cuda_graph_inputs import FEW_GROUPS, MANY_GROUPS, cascade_plan_shape
    from radixlm.backend.cuda_graph_runner import StaticCascadePlan
    from radixlm.kernels.cascade_plan import CascadePlan

    def fits(static: StaticCascadePlan, plan: CascadePlan) -> bool:
        shape = cascade_plan_shape(plan)
        return shape is not None and static.shape.fits(*shape)

    static = StaticCascadePlan(8, torch.device("cpu"), FEW_GROUPS)
    static.shared_lens.fill_(99)  # stale values from an earlier batch
    live = make_cascade_plan([3, 1, 2], [50, 0, 20], [60, 55, 51, 7, 25, 22], "cpu")
    static.load(live, 6)
    plan = static.plan(8, 4096)
    assert plan.group_ptr.tolist() == [0, 3, 4, 6, 6, 6, 6, 6, 6, 6]
    assert plan.group_shared_lens[:3].tolist() == [50, 0, 20]
    assert plan.shared_lens.tolist() == [50, 50, 50, 0, 20, 20, 0, 0]
    assert plan.shared_groups.tolist() == [0, 2] + [3] * (FEW_GROUPS.groups - 2)
    assert plan.max_shared_group_size == 8  # a few-groups graph's tiles cover one group of the batch
    assert fits(static, live)
    many = make_cascade_plan([2] * 5, [10] * 5, [20] * 10, "cpu")
    assert not fits(static, many)
    wide = StaticCascadePlan(64, torch.device("cpu"), MANY_GROUPS)
    assert fits(wide, many) and wide.plan(64, 4096).max_shared_group_size == MANY_GROUPS.members
    big_group = make_cascade_plan([MANY_GROUPS.members + 1] + [2] * 4, [10] * 5, [20] * 41, "cpu")
    assert fits(static, big_group) is False and fits(wide, big_group) is False


@pytest.mark.parametrize("max_bs", [8, 40, 825])
def test_cascade_graph_kinds_sizes(max_bs):
    """Few-groups graphs at every size from 2; many-groups graphs at powers of four from 16 and
    the largest size, so any batch with up to 64 groups of up to 32 members has one."""
    from radixlm.backend.cuda_graph_inputs import FEW_GROUPS, MANY_GROUPS
    from radixlm.backend.cuda_graph_runner import CascadeGraphs

    sizes = capture_batch_sizes(max_bs)
    assert CascadeGraphs.sizes_for(FEW_GROUPS, sizes) == [s for s in sizes if s >= 2]
    many = CascadeGraphs.sizes_for(MANY_GROUPS, sizes)
    assert many == {8: [], 40: [16, 40], 825: [16, 64, 256, 825]}[max_bs]
    for bs in range(2 * FEW_GROUPS.groups + 2, max_bs + 1):
        assert bucket_for(bs, many) is not None


def test_cascade_plans_pick_the_graph_kind_that_holds_them():
    """With cascade graphs captured (stand-in capture): a plan of 2 groups replays the few-groups
    graph, 6-7 small groups the many-groups graph, 7 groups with one of 40 members has none, and
    cascade_fits (what the cost model asks) answers the same from host ints."""
    cfg = ModelConfig.from_hf_dict(TINY)
    runner = ModelRunner(
        cfg, None, torch.device("cpu"), torch.float32, 2048, 0.9, 56, random_weights=True, seed=1
    )
    gr = CudaGraphRunner(runner.graph_target(), 48, eager_capture, cascade=True)
    assert gr.capture_all()
    few, many = gr.cascade
    assert few.inputs.shape.groups == 4 and many.inputs.shape.groups == 64
    assert sorted(many.graphs) == [16, 48] and 2 in few.graphs and 16 in few.graphs
    assert gr.cascade_fits(12, 2, 6) and gr.cascade_fits(12, 6, 2) and gr.cascade_fits(48, 6, 3)
    assert not gr.cascade_fits(46, 6, 40) and not gr.cascade_fits(12, 70, 2)
    runner.graph_runner = gr
    try:
        cases = [([6, 6], 12, "few"), ([2] * 6, 12, "many"), ([3] * 6 + [4], 22, "many")]
        for sizes, bs, kind in cases:
            fb, release = decode_batch(runner, [30] * bs, seed=bs)
            try:
                fb.cascade_plan = make_cascade_plan(sizes, [8] * len(sizes), fb.seq_lens_cpu, "cpu")
                before = (few.hits, many.hits)
                assert gr.can_run(fb)
                runner.forward(fb)
                assert (few.hits - before[0], many.hits - before[1]) == ((1, 0) if kind == "few" else (0, 1))
            finally:
                release()
        fb, release = decode_batch(runner, [30] * 46, seed=46)
        try:
            fb.cascade_plan = make_cascade_plan([40] + [1] * 6, [8] + [0] * 6, fb.seq_lens_cpu, "cpu")
            assert gr.can_run(fb)  # one shared group: the few-groups graph holds any size
            fb.cascade_plan = make_cascade_plan([40] + [1] * 6, [8] * 7, fb.seq_lens_cpu, "cpu")
            assert not gr.can_run(fb)  # 7 shared groups, one of 40 members: no graph holds it
        finally:
            release()
    finally:
        runner.graph_runner = None
        gr.disable()
