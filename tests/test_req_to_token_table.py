"""ReqToTokenTable's host mirror and its deferred device writes, against a naive model (a dict of
cells): after any mix of write / write_many / clear_row, the mirror holds the latest value of
every cell, and sync_device() brings the device table to exactly the mirror, whatever order the
writes came in (a cell written twice, a row cleared between writes). The device side is a second
CPU tensor here (host_mirror=True), so the test needs no GPU."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.backend.kv_pool import ReqToTokenTable

ROWS, COLS = 4, 12

op = st.one_of(
    st.tuples(
        st.just("write"),
        st.integers(0, ROWS - 1),
        st.integers(0, COLS - 1),
        st.lists(st.integers(1, 999), min_size=0, max_size=5),
    ),
    st.tuples(
        st.just("write_many"),
        st.lists(
            st.tuples(st.integers(0, ROWS - 1), st.integers(0, COLS - 1), st.integers(1, 999)), max_size=6
        ),
    ),
    st.tuples(st.just("clear_row"), st.integers(0, ROWS - 1)),
    st.tuples(
        st.just("sync"),
    ),
)


def _dense(cells: dict[tuple[int, int], int]) -> torch.Tensor:
    out = torch.zeros(ROWS, COLS, dtype=torch.int64)
    for (r, c), v in cells.items():
        out[r, c] = v
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=30))
def test_device_table_equals_the_mirror_after_each_sync(ops) -> None:
    table = ReqToTokenTable(ROWS, COLS, "cpu", host_mirror=True)
    assert table.table is not table.host
    cells: dict[tuple[int, int], int] = {}
    for o in ops:
        if o[0] == "write":
            _, row, start, values = o
            values = values[: COLS - start]
            table.write(row, start, torch.tensor(values, dtype=torch.int64))
            cells.update({(row, start + i): v for i, v in enumerate(values)})
        elif o[0] == "write_many":
            triples = list({(r, c): (r, c, v) for r, c, v in o[1]}.values())  # one value per cell in a batch
            rows, cols, values = ([t[i] for t in triples] for i in range(3))
            table.write_many(rows, cols, torch.tensor(values, dtype=torch.int64))
            cells.update({(r, c): v for r, c, v in triples})
        elif o[0] == "clear_row":
            table.clear_row(o[1])
            cells = {k: v for k, v in cells.items() if k[0] != o[1]}
        else:
            table.sync_device()
            assert torch.equal(table.table, table.host)
        assert torch.equal(table.host, _dense(cells))
        assert table.read(1, 2, 7).tolist() == _dense(cells)[1, 2:7].tolist()
    table.sync_device()
    assert torch.equal(table.table, _dense(cells))


def test_writes_reach_the_device_only_at_sync() -> None:
    table = ReqToTokenTable(2, 8, "cpu", host_mirror=True)
    table.write(1, 3, torch.tensor([5, 6, 7]))
    table.write_many([0, 1], [0, 6], torch.tensor([9, 8]))
    assert not table.table.any()  # deferred: nothing copied yet
    table.sync_device()
    assert table.table[1].tolist() == [0, 0, 0, 5, 6, 7, 8, 0] and table.table[0].tolist() == [9] + [0] * 7
    shared = ReqToTokenTable(2, 8, "cpu")  # on the CPU the mirror is the table itself
    shared.write(0, 0, torch.tensor([4]))
    assert shared.table is shared.host and shared.table[0, 0] == 4
