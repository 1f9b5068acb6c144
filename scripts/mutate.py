"""A small scripted mutation run: how many mutants of one module the tests fail to kill.

Each mutant changes one thing in the module's source (AST level): a comparison
operator flipped (``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``in``/``not in``,
``is``/``is not``), an ``and``/``or`` swapped, an integer constant changed by one, or a
``raise`` statement replaced by ``pass`` (the check removed). For each mutant a forked
child of this process (torch, pytest and the module imported once) executes the mutated
source, swaps its functions into every module that imported the originals and its
methods onto the original classes (which keep their identity), and runs the given
pytest arguments with a timeout; a mutant "survives" when the tests pass. Nothing is
written to the tree. Used for docs/mutation-testing.md (see that page).

Usage::

    python scripts/mutate.py --module kvpage.attention.checks --out out/mutants.json \
        -- -q -x -p no:cacheprovider conformance/test_contract.py --backend torch -n 0
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from pathlib import Path
from types import FunctionType

FLIP: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip


def _sites(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(kind, node index in ast.walk order, operand index) of every mutation site."""
    out = []
    for i, node in enumerate(ast.walk(tree)):
        if isinstance(node, ast.Compare):
            out += [("cmp", i, j) for j, op in enumerate(node.ops) if type(op) in FLIP]
        elif isinstance(node, ast.BoolOp):
            out.append(("bool", i, 0))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out.append(("int", i, 0))
        elif isinstance(node, ast.Raise):
            out.append(("raise", i, 0))
    return out


class _RaiseToPass(ast.NodeTransformer):
    def __init__(self, target: ast.AST) -> None:
        self.target = target

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        return ast.Pass() if node is self.target else node


def mutate(source: str, site: tuple[str, int, int]) -> tuple[str, int, str]:
    """The mutated source, the line of the site and a description."""
    tree = ast.parse(source)
    kind, idx, j = site
    node = list(ast.walk(tree))[idx]
    line = getattr(node, "lineno", 0)
    if kind == "cmp":
        assert isinstance(node, ast.Compare)
        old = node.ops[j]
        node.ops[j] = FLIP[type(old)]()
        desc = f"{type(old).__name__} -> {type(node.ops[j]).__name__}"
    elif kind == "bool":
        assert isinstance(node, ast.BoolOp)
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        desc = f"bool op -> {type(node.op).__name__}"
    elif kind == "int":
        assert isinstance(node, ast.Constant)
        node.value = node.value + 1
        desc = f"int {node.value - 1} -> {node.value}"
    else:
        tree = _RaiseToPass(node).visit(tree)
        desc = "raise -> pass"
    return ast.unparse(ast.fix_missing_locations(tree)), line, desc


def _patch_methods(original: type, mutant: type) -> None:
    """Put the mutant class's methods (and properties) onto the original class object.

    The class keeps its identity (isinstance, subclasses and references elsewhere see
    the original), so a mutation inside a method body is exercised. Not exercised: a
    mutated class-level value (a dataclass default, a class constant) and a method using
    zero-argument ``super()`` (its ``__class__`` cell names the mutant class).
    """
    for name, attr in vars(mutant).items():
        if isinstance(attr, (FunctionType, property, staticmethod, classmethod)):
            setattr(original, name, attr)


def _run_mutant(modname: str, mutated: str, args: list[str], timeout: float) -> str:
    """Fork; in the child swap the module's objects for the mutant's and run pytest."""
    import importlib
    import signal

    pid = os.fork()
    if pid == 0:  # child
        try:
            signal.alarm(int(timeout))
            import pytest

            original = importlib.import_module(modname)
            new = dict(vars(original))
            exec(compile(mutated, original.__file__ or modname, "exec"), new)
            for k, v in vars(original).items():  # keep classes: subclasses and isinstance
                if isinstance(v, type):  # elsewhere refer to the originals
                    mutant_cls = new.get(k)
                    if isinstance(mutant_cls, type) and mutant_cls is not v:
                        _patch_methods(v, mutant_cls)
                    new[k] = v
            swap = {
                id(v): new[k]
                for k, v in vars(original).items()
                if k in new and not k.startswith("__")
            }
            for mod in list(sys.modules.values()):
                d = getattr(mod, "__dict__", None)
                if not d:
                    continue
                for k, v in list(d.items()):
                    if id(v) in swap and swap[id(v)] is not v:
                        d[k] = swap[id(v)]
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            code = pytest.main(args)
            os._exit(0 if code == 0 else 1)
        except BaseException:
            os._exit(2)
    # the child's alarm is only a backstop: pytest-timeout (configured in pyproject)
    # installs its own SIGALRM handler, so the parent enforces the timeout as well
    deadline = time.monotonic() + timeout + 5.0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.05)
    if os.WIFSIGNALED(status):
        return "timeout" if os.WTERMSIG(status) == signal.SIGALRM else "killed"
    return "survived" if os.WEXITSTATUS(status) == 0 else "killed"


def main() -> None:
    import importlib

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", required=True, help="dotted module name to mutate")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--shard", default="0/1", help="i/n: run every n-th mutant from the i-th")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- pytest arguments")
    a = ap.parse_args()
    args = a.args[1:] if a.args and a.args[0] == "--" else a.args
    import pytest  # noqa: F401  (imported once, shared by the forked children)
    import torch  # noqa: F401

    mod = importlib.import_module(a.module)
    backends = importlib.import_module("kvpage.backends")
    probe = importlib.import_module("kvpage.specs").make_cache_spec(
        num_layers=1,
        block_size=4,
        num_blocks=4,
        layers=[dict(num_q_heads=2, num_kv_heads=1, head_dim=8)],
    )
    for name in backends.available_backends():  # import every plugin (numba...) once, here
        backends.backend_reasons(name, probe, "cpu")
    source = Path(mod.__file__ or "").read_text()
    shard, shards = (int(x) for x in a.shard.split("/"))
    sites = _sites(ast.parse(source))[shard::shards]
    base = _run_mutant(a.module, source, args, a.timeout * 3)
    if base != "survived":
        sys.exit(f"the unmutated module fails its tests ({base})")
    results = []
    t0 = time.time()
    for site in sites:
        mutated, line, desc = mutate(source, site)
        status = _run_mutant(a.module, mutated, args, a.timeout)
        results.append({"line": line, "mutation": desc, "status": status})
        print(f"{len(results)}/{len(sites)} line {line} {desc}: {status}", flush=True)
    summary = {
        "module": a.module,
        "pytest_args": " ".join(args),
        "mutants": len(results),
        "killed": sum(r["status"] != "survived" for r in results),
        "survived": sum(r["status"] == "survived" for r in results),
        "seconds": round(time.time() - t0, 1),
        "survivors": [r for r in results if r["status"] == "survived"],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "survivors"}))


if __name__ == "__main__":
    main()
