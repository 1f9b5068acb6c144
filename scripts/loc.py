"""Lines of code per package: the one line counter of the repository.

A line counts as code when it holds a code token; docstrings (every string that is an
expression statement, found with ``ast``: module, class and function docstrings and
attribute docstrings alike), ``#`` comments and blank lines are counted apart.

Usage: ``python scripts/loc.py [ROOT]`` prints one row per package of ``src/kvpage``,
per plugin under ``backends/`` and for ``docs/examples``: files, code, docstring,
comment-only and blank lines, and the total.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

_LAYOUT = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


def count(path: Path) -> tuple[int, int, int, int]:
    """``(code, docstring, comment-only, blank)`` lines of one file."""
    src = path.read_text()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(src, str(path))):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            doc.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    code: set[int] = set()
    comment: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comment.add(tok.start[0])
        elif tok.type not in _LAYOUT:
            code.update(ln for ln in range(tok.start[0], tok.end[0] + 1) if ln not in doc)
    blank = sum(1 for line in src.splitlines() if not line.strip())
    return len(code), len(doc), len(comment - code - doc), blank


def package_of(rel: tuple[str, ...]) -> str:
    """The row a file (path parts relative to the root) is counted in."""
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
    rows: dict[str, list[int]] = {}
    for p in sorted(files):
        row = rows.setdefault(package_of(p.relative_to(root).parts), [0, 0, 0, 0, 0])
        row[0] += 1
        for i, v in enumerate(count(p)):
            row[i + 1] += v
    head = ("package", "files", "code", "docstr", "comment", "blank")
    print(f"{head[0]:28s}" + "".join(f"{h:>8s}" for h in head[1:]))
    total = [0] * 5
    for name, row in sorted(rows.items()):
        total = [a + b for a, b in zip(total, row)]
        print(f"{name:28s}" + "".join(f"{v:8d}" for v in row))
    print(f"{'TOTAL':28s}" + "".join(f"{v:8d}" for v in total))


if __name__ == "__main__":
    main()
