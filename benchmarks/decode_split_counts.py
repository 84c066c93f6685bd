"""Decode attention (partial + merge) at fixed split counts over live lengths: the count a decode
CUDA graph runs with (sized for a 16,384-token context) beside 12 and 16, at B=1/4/16. One JSON
line per shape; µs per call from CUDA-graph replays, cold L2. For A/Bs of the split path: run it
from each version's tree with that version on PYTHONPATH. GPU only.

    python benchmarks/decode_split_counts.py TAG"""

from __future__ import annotations

import json
import sys

import torch
from kernels_common import DEV, DT, HKV, HQ, D, graph_splits, kv_sets, n_sets, paged_table, time_fn

from radixlm.kernels.decode_attention import decode_attention

SHAPES = [(1, 512), (1, 768), (1, 1024), (1, 2048), (1, 4096), (4, 1024), (16, 1024)]


def time_shape(bsz: int, seq_len: int) -> dict[str, float | int]:
    seq = [seq_len] * bsz
    table, n_slots = paged_table(seq)
    sets = kv_sets(n_slots, n_sets(2 * bsz * seq_len * HKV * D * 2))
    qs = [torch.randn(bsz, HQ, D, dtype=DT, device=DEV) for _ in sets]
    lens = torch.tensor(seq, device=DEV)
    ridx = torch.arange(bsz, device=DEV)
    in_graph = graph_splits(bsz)
    row: dict[str, float | int] = {"B": bsz, "L": seq_len, "graph_splits": in_graph}
    for s in sorted({in_graph, 12, 16}):
        fns = [
            lambda i=i, s=s: decode_attention(qs[i], *sets[i], table, ridx, lens, num_splits=s)
            for i in range(len(sets))
        ]
        row[f"us_{s}"] = round(time_fn(fns, 40, 7) * 1e6, 3)
    return row


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else ""
    for bsz, seq_len in SHAPES:
        print(json.dumps({"tag": tag, **time_shape(bsz, seq_len)}), flush=True)


if __name__ == "__main__":
    main()
