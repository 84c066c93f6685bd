"""GPU checks of decode CUDA graphs (skipped without CUDA): greedy outputs of the default model in
bf16 with graphs on agree with `disable_cuda_graph=True` for batches of 8, 3, 5 and 17 prompts
(the last three padded up to 4, 8 and 24), graphs really ran, and one padded replay matches the
eager forward, touches no KV slot but its own and slot 0, and never syncs with the host."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import mem_fraction, skip_without_default_weights
from test_cuda_graph import decode_batch, verify_rows_vs_extend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import numpy as np\n",
    "My favourite recipe for bread",
    "Q: What is 17 * 23?\nA:",
    "The quick brown fox",
    "In 1969, the first humans",
    "SELECT name FROM users WHERE",
    "Dear hiring manager,",
    "The mitochondria is",
    "Here is a haiku about autumn:",
    "To be or not to be,",
    "The best way to learn Python is",
    "Photosynthesis converts",
    "A list of prime numbers: 2, 3, 5,",
]
BATCH_SIZES = (8, 3, 5, 17)
PARAMS = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
MUST_MATCH = 16  # bf16: a late near-tie may flip between split counts; the start must agree


def _engine(**kw):
    from radixlm.backend.engine import Engine

    return Engine(device="cuda", dtype="bfloat16", mem_fraction_static=mem_fraction(0.3), **kw)


def _generate_all(eng) -> dict[int, list[list[int]]]:
    out = {}
    for bs in BATCH_SIZES:
        eng.flush_cache()
        out[bs] = [r["output_ids"] for r in eng.generate(PROMPTS[:bs], PARAMS)]
    return out


def _one_padded_step(eng) -> dict:
    """On the scheduler thread: a decode batch of 5 (graph size 8) by replay vs the eager model."""
    runner = eng.runner

    def run() -> dict:
        fb, release = decode_batch(runner, [5, 17, 33, 64, 100], seed=0)
        try:
            eager = runner.model(fb).clone()  # also writes the new tokens' KV (same values)
            held = torch.cat(
                [runner.req_table.table[r, :n] for r, n in zip(fb.req_pool_indices_cpu, fb.prefix_lens_cpu)]
            )
            k0 = runner.kv_pool.k_buffers[0][held].clone()
            hits = sum(runner.graph_runner.bucket_hits.values())
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            sync_error = ""
            try:
                got = runner.forward(fb)
            except RuntimeError as e:  # a host sync inside the replay path
                sync_error = str(e)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            if sync_error:
                got = runner.forward(fb)
            torch.cuda.synchronize()
            return {
                "sync_error": sync_error,
                "rel": ((got - eager).norm() / eager.norm()).item(),
                "argmax_same": int((got.argmax(-1) == eager.argmax(-1)).sum()),
                "shape": tuple(got.shape),
                "eager_shape": tuple(eager.shape),
                "prefix_kv_kept": bool(torch.equal(runner.kv_pool.k_buffers[0][held], k0)),
                "replayed": sum(runner.graph_runner.bucket_hits.values()) - hits,
            }
        finally:
            release()

    return eng._call(run)


def _graph_run() -> dict:
    eng = _engine()
    try:
        gr = eng.runner.graph_runner
        info = {
            "enabled": gr is not None and gr.enabled,
            "sizes": list(gr.sizes) if gr else [],
            "max_running": eng.scheduler.cfg.max_running_requests,
        }
        info["graph"] = _generate_all(eng)
        info["hits"] = dict(gr.bucket_hits) if gr else {}
        info["step"] = _one_padded_step(eng) if gr else {}
        return info
    finally:
        eng.shutdown()


def _eager_run() -> dict:
    eng = _engine(disable_cuda_graph=True)
    try:
        return {"eager_runner_has_graphs": eng.runner.graph_runner is not None, "eager": _generate_all(eng)}
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def runs() -> dict:
    skip_without_default_weights()
    info = _graph_run()  # its engine is garbage once this returns, so _engine() can reclaim it
    info.update(_eager_run())
    print("captured sizes:", info["sizes"], "bucket hits:", info["hits"], "step:", info["step"])
    return info


def test_graphs_captured_and_used(runs):
    assert runs["enabled"], "graph capture fell back to eager (see the warning in the log)"
    # graphs cover every batch the scheduler may run, up to the device's cap (1,024 on 80 GB GPUs)
    cap = 1024 if torch.cuda.get_device_properties(0).total_memory >= 80 << 30 else 256
    assert runs["sizes"][:5] == [1, 2, 4, 8, 16] and runs["sizes"][-1] == min(cap, runs["max_running"])
    assert not runs["eager_runner_has_graphs"]
    # up to 31 decode steps per generate call at the full batch (requests reach the scheduler one
    # by one, so the first steps may mix prefill and decode): 8 → 8, 3 → 4, 5 → 8, 17 → 24
    assert runs["hits"].get(4, 0) >= 20 and runs["hits"].get(24, 0) >= 20
    assert runs["hits"].get(8, 0) >= 40


@pytest.mark.parametrize("bs", BATCH_SIZES)
def test_greedy_outputs_match_eager(runs, bs):
    graph, eager = runs["graph"][bs], runs["eager"][bs]
    assert len(graph) == len(eager) == bs
    for i, (g, e) in enumerate(zip(graph, eager)):
        assert len(g) == len(e) == PARAMS["max_new_tokens"]
        agree = next((k for k, (a, b) in enumerate(zip(g, e)) if a != b), len(g))
        print(f"bs {bs} request {i}: first {agree}/{len(g)} tokens agree")
        assert g[:MUST_MATCH] == e[:MUST_MATCH], f"request {i} diverged at token {agree}"


def test_padded_replay_matches_eager_without_host_sync(runs):
    step = runs["step"]
    assert not step["sync_error"], f"host sync in the replay path: {step['sync_error']}"
    assert step["replayed"] == 1, "the decode batch of 5 did not go through a graph"
    assert step["shape"] == step["eager_shape"] == (5, step["eager_shape"][1])
    assert step["rel"] < 2e-2, f"bf16 relative error {step['rel']:.3e}"
    assert step["argmax_same"] >= 4
    assert step["prefix_kv_kept"]


def test_real_capture_failure_recovers_then_capture_works():
    """Tiny random model on the GPU: a capture that syncs (.item()) fails inside torch.cuda.graph,
    the runner falls back; the device stays usable, and a clean capture on the same runner then
    replays padded batches like the eager forward."""
    from radixlm.backend.cuda_graph_runner import CudaGraphCapture, CudaGraphRunner

    runner = _tiny_cuda_runner(torch.bfloat16)
    assert runner.graph_runner is None
    cap = CudaGraphCapture(runner.device)

    def syncing(fn):
        return cap(lambda: (torch.ones(1, device="cuda").sum().item(), fn())[1])

    bad = CudaGraphRunner(runner.graph_target(), 4, syncing)
    assert not bad.capture_all() and not bad.enabled
    good = CudaGraphRunner(runner.graph_target(), 8, CudaGraphCapture(runner.device))
    assert good.capture_all() and good.enabled
    runner.graph_runner = good
    for lens in ([3], [7, 20, 1], [5, 9, 33, 2, 64]):
        fb, release = decode_batch(runner, lens, seed=len(lens))
        try:
            eager = runner.model(fb).clone()
            got = runner.forward(fb)
            rel = ((got - eager).norm() / eager.norm()).item()
            print(f"tiny model, lens {lens}: graph vs eager rel err {rel:.2e}")
            assert got.shape == eager.shape and rel < 2e-2
        finally:
            release()
    assert sum(good.bucket_hits.values()) == 3


def test_verify_rows_replay_matches_eager_extend():
    """Float32 tiny model on the GPU (Triton attention, real capture): a verify step's tokens and
    drafts, a forced-token run and a decode, as decode rows through a graph, give the eager
    extend's logits."""
    from radixlm.backend.cuda_graph_runner import CudaGraphCapture, CudaGraphRunner

    runner = _tiny_cuda_runner(torch.float32)
    graphs = CudaGraphRunner(runner.graph_target(), 8, CudaGraphCapture(runner.device))
    assert graphs.capture_all()
    runner.graph_runner = graphs
    got, eager = verify_rows_vs_extend(runner, graphs)
    rel = ((got - eager).norm() / eager.norm()).item()
    print(
        f"verify rows vs eager extend: rel err {rel:.2e}, top-1 agree {(got.argmax(-1) == eager.argmax(-1)).tolist()}"
    )
    assert rel < 1e-4


def test_short_fresh_prompt_rows_replay_matches_eager_extend():
    """The same tiny model: a fresh 40-token prompt (past the per-item row limit, inside the
    extra-read bound) runs as decode rows through a real graph and gives the eager extend's logit."""
    from test_cuda_graph import fresh_prompt_graph_vs_eager

    from radixlm.backend.cuda_graph_runner import CudaGraphCapture, CudaGraphRunner

    runner = _tiny_cuda_runner(torch.float32)
    graphs = CudaGraphRunner(runner.graph_target(), 48, CudaGraphCapture(runner.device))
    assert graphs.capture_all()
    got, eager, graphed = fresh_prompt_graph_vs_eager(runner, graphs, 40)
    rel = ((got - eager).norm() / eager.norm()).item()
    print(f"fresh prompt rows vs eager extend: rel err {rel:.2e}")
    assert graphed and rel < 1e-4


def _tiny_cuda_runner(dtype: torch.dtype):
    """test_cuda_graph's tiny random model (hidden 128) on the GPU, without graphs of its own."""
    from test_cuda_graph import TINY

    from radixlm.backend.model_config import ModelConfig
    from radixlm.backend.model_runner import ModelRunner

    cfg = ModelConfig.from_hf_dict({**TINY, "hidden_size": 128, "max_position_embeddings": 1024})
    return ModelRunner(
        cfg, None, torch.device("cuda"), dtype, 2048, 0.95, 16, random_weights=True, disable_cuda_graph=True
    )
