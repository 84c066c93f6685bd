"""Running kernel checks under TRITON_INTERPRET=1 in a subprocess (the interpreter must be on
before the kernels are defined): the test file runs itself as a script with a random seed, each
group of checks reports (label, error, bound) records or the exception it raised, and the test
side asserts every record within its bound, naming the seed so a failure reproduces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence


def run_script(path: str, timeout: float = 900) -> dict:
    """path run as a script under the interpreter: {group: records or error text, "_seed": seed}."""
    seed = str(int.from_bytes(os.urandom(2), "little"))
    env = dict(os.environ, TRITON_INTERPRET="1", KERNEL_TEST_SEED=seed)
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"checker crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS ") :]) | {"_seed": seed}


def main(checks: Callable[[str], list], groups: Sequence[str]) -> None:
    """The script side: seed torch, run the groups named on the command line (else all), print
    one RESULTS line."""
    import torch

    torch.manual_seed(int(os.environ.get("KERNEL_TEST_SEED", "0")))
    results: dict[str, list | str] = {}
    for group in sys.argv[1:] or groups:
        t0 = time.perf_counter()
        try:
            results[group] = [list(r) for r in checks(group)]
        except Exception as exc:  # reported per group, so one broken kernel does not hide the rest
            results[group] = f"{type(exc).__name__}: {exc}"
        print(f"{group}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print("RESULTS " + json.dumps(results))


def assert_records(recs: list | str, seed: str = "", what: str = "") -> None:
    assert not isinstance(recs, str), f"{what} raised: {recs}"
    assert recs, f"{what} produced no checks"
    bad = [(label, err, bound) for label, err, bound in recs if not err <= bound]
    assert not bad, f"seed {seed}: failed {bad}"
