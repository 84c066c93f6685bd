"""The greedy argmax kernel (`radixlm.kernels.argmax`) against torch.argmax, exactly: rows that
end inside a chunk, ties within and across chunks, NaN and infinities, under TRITON_INTERPRET=1
in a subprocess (the interpreter must be on before the kernels are defined), and the Llama-3
vocabulary on a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def cases(device: str) -> list[tuple[str, torch.Tensor]]:
    """Named [N, V] inputs whose argmax depends on the tie, NaN and chunk-edge rules."""
    g = torch.Generator().manual_seed(0)
    out: list[tuple[str, torch.Tensor]] = []
    for n, v in [(1, 100), (3, 4096), (2, 4097), (4, 12289)]:
        out.append((f"random {n}x{v}", torch.randn(n, v, generator=g)))
    x = torch.randn(3, 9000, generator=g)
    x[0, [5000, 8999]] = 7.0  # a tie across chunks: the first wins
    x[1, [4096, 4095]] = 7.0  # ties on both sides of a chunk edge
    x[2, [17, 18]] = 7.0  # a tie inside one chunk
    out.append(("ties", x))
    x = torch.randn(5, 9000, generator=g)
    x[0, 6000] = float("nan")
    x[1, [100, 5000]] = float("nan")  # the first NaN wins
    x[2, 10], x[2, 8000] = float("inf"), float("nan")  # NaN beats +inf after it
    x[3, :] = float("-inf")  # all -inf: index 0
    x[4, :] = float("-inf")
    x[4, 8191] = -3.0
    out.append(("nan and inf", x))
    out.append(("bf16", torch.randn(2, 5000, generator=g).to(torch.bfloat16)))
    return [(name, t.to(device)) for name, t in out]


def mismatches(device: str) -> dict[str, list[list[int]]]:
    """{case: [[row, kernel index, torch index], ...]} for every row that disagrees."""
    from radixlm.kernels.argmax import argmax_rows

    found: dict[str, list[list[int]]] = {}
    for name, x in cases(device):
        got, want = argmax_rows(x).cpu(), torch.argmax(x, dim=-1).cpu()
        assert got.dtype == torch.int64 and got.shape == want.shape, (name, got.dtype, got.shape)
        found[name] = [[r, int(got[r]), int(want[r])] for r in range(len(want)) if got[r] != want[r]]
    return found


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU CI check; on a GPU the compiled kernel is tested")
def test_argmax_rows_equals_torch_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == len(cases("cpu"))
    assert not any(found.values()), found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_argmax_rows_equals_torch_on_gpu() -> None:
    from radixlm.kernels.argmax import argmax_rows

    assert not any(mismatches("cuda").values())
    for n in (1, 7, 128):
        x = torch.randn(n, 128256, device="cuda")
        x[:, 128255] = x.max() + 1  # the last column, in the last, partial chunk
        x[n // 2, 3] = x[n // 2, 128255]  # a tie with the first chunk
        assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


def test_argmax_rows_rejects_other_ranks_and_leaves_some_rows_to_torch(monkeypatch) -> None:
    """Inputs the kernel does not take go to torch.argmax even where Triton would run: here a
    launch on CPU tensors without the interpreter would raise."""
    from radixlm.kernels import argmax

    with pytest.raises(ValueError, match="rows, columns"):
        argmax.argmax_rows(torch.randn(5))
    monkeypatch.setattr(argmax, "use_triton", lambda t: True)
    x = torch.randn(3, 7)[:, ::2]  # not unit-stride
    assert torch.equal(argmax.argmax_rows(x), torch.argmax(x, dim=-1))
    assert argmax.argmax_rows(torch.empty(0, 5)).shape == (0,)
    y = torch.tensor([[1.0, 1.0 + 1e-12]], dtype=torch.float64)  # equal once rounded to fp32
    assert argmax.argmax_rows(y).tolist() == [1]


if __name__ == "__main__":
    print(json.dumps(mismatches("cpu")))
