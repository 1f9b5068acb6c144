"""cloc-style line count by package of a source tree (default src/kvpage): code lines
exclude blank lines, # comments and docstrings. Usage: python scripts/loc_by_package.py [DIR]."""

import ast
import collections
import io
import sys
import tokenize
from pathlib import Path


def count(path):
    src = path.read_text()
    lines = src.splitlines()
    doc = set()
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            doc.update(range(node.lineno, node.end_lineno + 1))
    comment = set()
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comment.add(tok.start[0])
        elif tok.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            for ln in range(tok.start[0], tok.end[0] + 1):
                if ln not in doc:
                    code.add(ln)
    blank = sum(1 for line in lines if not line.strip())
    return len(code), len(doc), len(comment - code), blank, len(lines)


root = Path(sys.argv[1] if len(sys.argv) > 1 else "src/kvpage")
agg = collections.defaultdict(lambda: [0, 0, 0, 0, 0, 0])
for p in sorted(root.rglob("*.py")):
    rel = p.relative_to(root).parts
    pkg = rel[0] if len(rel) > 1 else "(top-level modules)"
    c = count(p)
    a = agg[pkg]
    a[0] += 1
    for i, v in enumerate(c):
        a[i + 1] += v
tot = [0] * 6
print(
    f"{'package':22s} {'files':>5s} {'code':>6s} {'docstr':>6s} {'comment':>7s} {'blank':>6s} {'total':>6s}"
)
for k in sorted(agg):
    a = agg[k]
    tot = [x + y for x, y in zip(tot, a)]
    print(f"{k:22s} {a[0]:5d} {a[1]:6d} {a[2]:6d} {a[3]:7d} {a[4]:6d} {a[5]:6d}")
print(f"{'TOTAL':22s} {tot[0]:5d} {tot[1]:6d} {tot[2]:6d} {tot[3]:7d} {tot[4]:6d} {tot[5]:6d}")
