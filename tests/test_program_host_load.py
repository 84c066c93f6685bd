"""`--programs` names: a module that is not there is the operator's mistake (ValueError, one line
at start-up); a module that is there but fails its own import is a bug and keeps its error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from radixlm.program_host import ProgramsHost


def test_a_missing_module_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"no module or \.py file named 'no_such_pkg_x\.programs'"):
        ProgramsHost.load(["no_such_pkg_x.programs"])


def test_an_import_error_inside_the_module_keeps_its_type(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_programs_mod.py").write_text("import no_such_dependency_y\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_y"):
        ProgramsHost.load(["broken_programs_mod"])
    sys.modules.pop("broken_programs_mod", None)


def test_a_module_with_programs_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "good_programs_mod.py").write_text(
        "import radixlm\n\n@radixlm.function\ndef hello(s):\n    s += 'hi'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert list(ProgramsHost.load(["good_programs_mod"]).programs()) == ["hello"]
    sys.modules.pop("good_programs_mod", None)
