"""``scripts/loc.py``, the one line counter, tells docstrings from code in every
position (module, class, function, attribute), not only at the top of a file."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_counts_docstrings_everywhere(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "loc", Path(__file__).resolve().parents[1] / "scripts" / "loc.py"
    )
    assert spec is not None and spec.loader is not None
    loc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loc)
    f = tmp_path / "m.py"
    f.write_text(
        '"""Module."""\n\n'
        "# a comment\n"
        "class A:\n"
        '    """Class,\n    two lines."""\n\n'
        "    x = 1\n"
        '    """Attribute."""\n\n'
        "    def f(self):  # trailing\n"
        '        """Function."""\n'
        '        return "not a docstring"\n'
    )
    assert loc.count(f) == (4, 5, 1, 3)  # code, docstring, comment-only, blank
