"""Running Python in the folder above a clone named `radixlm/` makes that clone shadow the installed
package; the repo root's __init__.py must then still give the real package, language and runtime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_from_the_folder_above_a_clone_named_radixlm(tmp_path: Path) -> None:
    (tmp_path / "radixlm").symlink_to(ROOT, target_is_directory=True)
    code = (
        "import radixlm, radixlm.backend.engine as e, radixlm.grammars as g; "
        "print(radixlm.__file__, callable(radixlm.function), e.Engine.__name__, g.GrammarBackend.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    shadow, fn, engine, grammar = out.stdout.split()
    assert Path(shadow).parent == tmp_path / "radixlm"  # the clone was what Python imported
    assert (fn, engine, grammar) == ("True", "Engine", "GrammarBackend")
