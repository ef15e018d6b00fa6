"""How the engine is kept: the numbers the "engine as records" issue judges.

Prints, for the package in this checkout (or ``--package PATH``'s copy):

* the per-optimizer engine's instance attributes, and the assignments to an
  engine's attributes (or mutations of its containers) written in other core
  modules;
* code lines per core module (blank, comment and docstring lines not
  counted) and their total; the core is ``layeropt/`` minus ``plan/``,
  ``integrations/``, the demo, the models, the report, the memory tools and
  ``__main__``;
* the layeropt Python calls of one warmed plain backward (two Linear layers,
  ``bucket_cap_mb=0``, ``Adam(foreach=True)``) and how deep layeropt's frames
  nest at the deepest;
* the core's classes and module-level mutable states that
  ``docs/how-it-works.md`` does not name;
* the seams (issue 37): the modules at the top of ``layeropt/``; the lines of
  the engine's own modules (the engine class's and those of the classes it
  inherits) that name a feature installed beside it (offload, host memory,
  prefetch, verify).

Usage:
    python benchmarks/engine_report.py [--package /path/to/checkout]
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import sys
import tokenize
from pathlib import Path

OUTSIDE_CORE = {"plan", "integrations", "demo.py", "models.py", "report.py", "memory.py",
                "__main__.py"}


# A feature the engine's own modules must not name: it installs beside them.
FEATURE_WORDS = re.compile(r"offload|prefetch|verif|host|HostHeld|_lo_state_place", re.I)


def top_level_modules(pkg: Path) -> list[str]:
    return sorted(p.name for p in pkg.glob("*.py"))


def engine_modules(engine_cls: type) -> list[Path]:
    """The files of the engine class and of every layeropt class it inherits from."""
    files = {sys.modules[k.__module__].__file__ for k in engine_cls.__mro__
             if k.__module__.startswith("layeropt")}
    return sorted(Path(f).resolve() for f in files)


def feature_lines(paths: list[Path]) -> list[str]:
    """``file:line text`` for every line (code, comment or docstring) naming a feature."""
    return [f"{p.parent.name}/{p.name}:{i} {line.strip()}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if FEATURE_WORDS.search(line)]


def core_modules(pkg: Path) -> list[Path]:
    return sorted(p for p in pkg.rglob("*.py")
                  if p.relative_to(pkg).parts[0] not in OUTSIDE_CORE)


def code_lines(path: Path) -> int:
    """Lines holding code: no blank, comment-only or docstring lines."""
    source = path.read_text()
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(
                body[0].value.value, str):
            doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                        tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - doc_lines)


_ENGINE_NAMES = re.compile(r"^(engine|e|eng)$")
_MUTATORS = {"append", "extend", "clear", "pop", "popitem", "update", "setdefault", "add",
             "discard", "remove", "insert"}


def _is_engine(node: ast.AST) -> bool:
    """``engine``, ``e``, ``x._lo_engine``, ``opt._lo_engine`` ..."""
    if isinstance(node, ast.Name):
        return bool(_ENGINE_NAMES.match(node.id))
    return isinstance(node, ast.Attribute) and node.attr == "_lo_engine"


def outside_writes(pkg: Path, engine_module: str) -> list[str]:
    found = []
    for path in core_modules(pkg):
        if str(path.relative_to(pkg)) == engine_module:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if isinstance(base, ast.Attribute) and _is_engine(base.value):
                    found.append(f"{path.relative_to(pkg.parent)}:{node.lineno} "
                                 f"{ast.unparse(t)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Attribute)
                    and _is_engine(node.func.value.value)):
                found.append(f"{path.relative_to(pkg.parent)}:{node.lineno} "
                             f"{ast.unparse(node.func)}()")
    return found


def calls_per_backward() -> tuple[int, int, dict[str, int]]:
    import torch

    import layeropt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = layeropt.Adam(model.parameters(), lr=1e-3, foreach=True)
    layeropt.attach(model, opt, bucket_cap_mb=0)
    x = torch.randn(8, 64)
    for _ in range(3):  # warm: state made, fast path learned
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    loss = model(x).sum()
    root = os.path.dirname(os.path.abspath(layeropt.__file__)) + os.sep
    counts: dict[str, int] = {}
    depth = [0, 0]  # now, deepest

    def ours(frame) -> bool:
        return frame.f_code.co_filename.startswith(root)

    def profile(frame, event, arg):
        if event == "call" and ours(frame):
            name = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_qualname}"
            counts[name] = counts.get(name, 0) + 1
            n, f = 0, frame
            while f is not None:
                n += ours(f)
                f = f.f_back
            depth[1] = max(depth[1], n)

    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    return sum(counts.values()), depth[1], counts


def engine_attributes() -> list[str]:
    import torch

    import layeropt

    opt = layeropt.Adam([torch.nn.Parameter(torch.zeros(2))])
    engine = opt._lo_engine
    names = list(vars(engine)) if hasattr(engine, "__dict__") else []
    for cls in type(engine).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if s != "__weakref__"]
    return sorted(set(names))


def concepts(pkg: Path) -> list[tuple[str, str]]:
    """The core's classes and module-level mutable states: ``(module, name)``.

    A module-level name is state when some core module changes it: a mutating
    method call on it (``NAME.add(...)``), an item or attribute assigned on it,
    or a ``global NAME`` rebinding it. ``__all__`` and constants are not.
    """
    trees = {path: ast.parse(path.read_text()) for path in core_modules(pkg)}
    changed: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                changed.update(node.names)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    node.func.attr in _MUTATORS) and isinstance(node.func.value, ast.Name):
                changed.add(node.func.value.id)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(
                            t.value, ast.Name):
                        changed.add(t.value.id)
    out = []
    for path, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                out.append((path.name, node.name))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out += [(path.name, t.id) for t in targets if isinstance(t, ast.Name)
                        and t.id != "__all__" and t.id in changed
                        and not isinstance(node.value, (ast.Constant, ast.Lambda))]
    return out


def undocumented(pkg: Path, doc: Path) -> list[str]:
    """Core concepts (:func:`concepts`) that how-it-works.md does not name in backticks."""
    text = doc.read_text() if doc.exists() else ""
    return [f"{module}: {name}" for module, name in concepts(pkg)
            if not re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`", text)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--package", default=str(Path(__file__).resolve().parent.parent),
                   help="the checkout whose layeropt/ to measure (default: this one)")
    p.add_argument("--calls", action="store_true", help="list the calls of the backward")
    args = p.parse_args(argv)
    root = Path(args.package).resolve()
    sys.path.insert(0, str(root))
    for name in [m for m in sys.modules if m == "layeropt" or m.startswith("layeropt.")]:
        del sys.modules[name]
    import layeropt

    pkg = Path(layeropt.__file__).resolve().parent
    assert pkg == root / "layeropt", f"imported {pkg}, not {root / 'layeropt'}"
    engine_cls = type(layeropt.Adam([__import__("torch").zeros(1, requires_grad=True)])._lo_engine)
    engine_file = sys.modules[engine_cls.__module__].__file__
    engine_module = str(Path(engine_file).resolve().relative_to(pkg))
    attrs = engine_attributes()
    writes = outside_writes(pkg, engine_module)
    sizes = {str(p.relative_to(pkg)): code_lines(p) for p in core_modules(pkg)}
    calls, deepest, counts = calls_per_backward()
    missing = undocumented(pkg, root / "docs" / "how-it-works.md")
    print(f"package: {pkg}")
    print(f"engine ({engine_module}): {len(attrs)} instance attributes: {', '.join(attrs)}")
    print(f"writes to an engine from other core modules: {len(writes)}")
    for w in writes:
        print(f"  {w}")
    print(f"core code lines: {sum(sizes.values())} (largest module "
          f"{max(sizes.values())}: {max(sizes, key=sizes.get)})")
    for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {name}")
    print(f"warmed plain backward (2 x Linear(64), bucket_cap_mb=0, Adam foreach): "
          f"{calls} layeropt Python calls, {deepest} frames deep at the deepest")
    if args.calls:
        for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {n:3d}  {name}")
    print(f"core classes / module-level mutable states not named in how-it-works.md: "
          f"{len(missing)}")
    for m in missing:
        print(f"  {m}")
    top = top_level_modules(pkg)
    print(f"modules at the top of layeropt/: {len(top)} ({', '.join(top)}); subpackages: "
          f"{', '.join(sorted(d.name for d in pkg.iterdir() if (d / '__init__.py').exists()))}")
    own = engine_modules(engine_cls)
    named = feature_lines(own)
    print(f"lines of the engine's own modules ({', '.join(p.name for p in own)}) naming a "
          f"feature installed beside them: {len(named)}")
    for line in named:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
