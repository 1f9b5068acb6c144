"""Code lines per package: lines that hold code tokens (docstrings and comments excluded).

Usage: ``python scripts/loc.py [ROOT]`` prints ``package<TAB>files<TAB>code<TAB>docstring
lines`` per package of ``src/kvpage``, per plugin under ``backends/`` and for
``docs/examples``.
"""

from __future__ import annotations

import io
import sys
import tokenize
from pathlib import Path

_SKIP = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
_STMT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL)


def count(path: Path) -> tuple[int, int]:
    """(code lines, docstring lines) of one file."""
    code: set[int] = set()
    doc: set[int] = set()
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in _SKIP or tok.type == tokenize.ENDMARKER:
            continue
        is_doc = tok.type == tokenize.STRING and (prev is None or prev.type in _STMT_START)
        (doc if is_doc else code).update(range(tok.start[0], tok.end[0] + 1))
        prev = tok
    return len(code - doc), len(doc)


def package_of(rel: tuple[str, ...]) -> str:
    if rel[0] == "src":
        if len(rel) > 4 and rel[2] == "backends":
            return "kvpage/backends"
        return "kvpage/" + (rel[2] if len(rel) > 3 else "(top-level)")
    if rel[0] == "docs":
        return "docs/examples"
    return "backends/" + rel[1]


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    files = [*root.glob("src/kvpage/**/*.py"), *root.glob("backends/**/*.py")]
    files += root.glob("docs/examples/*.py")
    groups: dict[str, list[int]] = {}
    for p in sorted(files):
        c, d = count(p)
        g = groups.setdefault(package_of(p.relative_to(root).parts), [0, 0, 0])
        g[0] += 1
        g[1] += c
        g[2] += d
    for name, (n, c, d) in sorted(groups.items()):
        print(f"{name}\t{n}\t{c}\t{d}")


if __name__ == "__main__":
    main()
