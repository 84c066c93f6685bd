"""A script that starts an engine with spawned children at import time, without the main guard:
each child runs the script again and dies while starting. The script must fail at once with the
fix in its error (not after a rendezvous timeout, not with a bare EOFError), for tensor-parallel
workers and for the engine process alike; with the guard the same script runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_hf_parity import _tiny_model

# well under the 120 s the tensor-parallel rendezvous waited for a worker that had died
LIMIT_S = 90

ENGINES = {
    "tp": "from radixlm.backend.engine import Engine\n"
    "eng = Engine(model_path={path!r}, max_total_tokens=512, tp_size=2)\n",
    "process": "from radixlm.backend.engine_process import EngineProcess\n"
    "eng = EngineProcess(model_path={path!r}, max_total_tokens=512)\n",
}
USE = "out = eng.generate(input_ids=[5, 6, 7], sampling_params={'max_new_tokens': 2})\nprint('OK', out['output_ids'])\neng.shutdown()\n"


def _run(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=LIMIT_S, cwd=script.parent
    )


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_unguarded_script_fails_fast_with_the_fix(kind, tmp_path, default_model_dir):
    _, path = _tiny_model("llama3", tmp_path, default_model_dir)
    script = tmp_path / "unguarded.py"
    script.write_text(ENGINES[kind].format(path=str(path)) + USE)
    res = _run(script)
    assert res.returncode != 0, res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError:") and "while starting" in last, res.stderr[-2000:]
    assert 'if __name__ == "__main__":' in last


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_guarded_script_runs(kind, tmp_path, default_model_dir):
    _, path = _tiny_model("llama3", tmp_path, default_model_dir)
    script = tmp_path / "guarded.py"
    body = ENGINES[kind].format(path=str(path)) + USE
    script.write_text(
        "def main():\n"
        + "".join(f"    {line}\n" for line in body.splitlines())
        + "\n\nif __name__ == '__main__':\n    main()\n"
    )
    res = _run(script)
    assert res.returncode == 0 and "OK [" in res.stdout, res.stderr[-2000:]
