"""Imported only when Python runs in the folder above a clone named `radixlm/`: the clone then
shadows the installed package, so this makes `import radixlm` load the real one from the same tree
(the language in dsl/, the runtime folders beside it), as the installed package would."""

from pathlib import Path as _Path

_ROOT = _Path(__file__).resolve().parent
__path__ = [str(_ROOT / "dsl"), str(_ROOT)]  # radixlm.<module> from dsl/, radixlm.backend etc. from here
_init = _ROOT / "dsl" / "__init__.py"
exec(compile(_init.read_text(), str(_init), "exec"))  # noqa: S102 - dsl/__init__.py is the package body
