"""Generate ``docs/api.md``, the API reference, from layeropt's docstrings.

The sources are parsed, not imported, so the output is the same whatever is
installed (torch version, transformers or not). Each module in ``MODULES`` is
listed with the first paragraph of its docstring, then every name in its
``__all__``: signature and full docstring (methods and properties of classes
too). ``tests/test_docs_api.py`` fails when ``docs/api.md`` is out of date.

Usage:
    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is out of date
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"
MODULES = [
    "layeropt.optim", "layeropt.attaching", "layeropt.backward_pass", "layeropt.landing",
    "layeropt.checkpointing", "layeropt.loop", "layeropt.losses", "layeropt.memory",
    "layeropt.distributed", "layeropt.integrations", "layeropt.integrations.hf",
    "layeropt.integrations.lightning",
    "layeropt.integrations.accelerate", "layeropt.report", "layeropt.demo",
    "layeropt.models", "layeropt.plan", "layeropt.errors",
]
WIDTH = 88
PROTOCOL = {"forward", "extra_repr"}


def _path(module: str) -> pathlib.Path:
    base = ROOT / pathlib.Path(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Top-level statements, looking inside ``if`` / ``try`` blocks."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _statements(node.body) + _statements(node.orelse)
        elif isinstance(node, ast.Try):
            out += _statements(node.body) + _statements(node.orelse)
    return out


def _assigns(node: ast.stmt, name: str) -> bool:
    """Whether ``node`` is ``name = ...`` or ``name: T = ...``."""
    if isinstance(node, ast.Assign):
        return any(getattr(t, "id", "") == name for t in node.targets)
    return isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == name \
        and node.value is not None


def _all(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in _statements(tree.body):
        if _assigns(node, "__all__"):
            names = list(ast.literal_eval(node.value))  # type: ignore[attr-defined]
        elif isinstance(node, ast.AugAssign) and getattr(node.target, "id", "") == "__all__":
            names += list(ast.literal_eval(node.value))
        elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
              and ast.unparse(node.value.func) in ("__all__.append", "__all__.extend")):
            value = ast.literal_eval(node.value.args[0])
            names += [value] if isinstance(value, str) else list(value)
    return list(dict.fromkeys(names))


def _arg(a: ast.arg, default: ast.expr | None) -> str:
    text = a.arg + (f": {ast.unparse(a.annotation)}" if a.annotation else "")
    if default is not None:
        text += (" = " if a.annotation else "=") + ast.unparse(default)
    return text


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> str:
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = [_arg(a, d) for a, d in zip(positional, defaults)]
    if args.posonlyargs:
        parts.insert(len(args.posonlyargs), "/")
    if args.vararg:
        parts.append("*" + _arg(args.vararg, None))
    elif args.kwonlyargs:
        parts.append("*")
    parts += [_arg(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        parts.append("**" + _arg(args.kwarg, None))
    if method and parts and parts[0].split(":")[0] in ("self", "cls"):
        parts = parts[1:]
    ret = f" -> {ast.unparse(fn.returns)}" if fn.returns else ""
    one_line = f"{fn.name}({', '.join(parts)}){ret}"
    if len(one_line) <= WIDTH:
        return one_line
    return f"{fn.name}(\n" + "".join(f"    {p},\n" for p in parts) + f"){ret}"


def _doc(node: ast.AST) -> list[str]:
    doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
    if not doc:
        return ["*(no docstring)*", ""]
    return ["```text", doc, "```", ""]


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {ast.unparse(d) for d in fn.decorator_list}


def _function(fn: ast.FunctionDef | ast.AsyncFunctionDef, prefix: str, level: str) -> list[str]:
    kind = "property " if "property" in _decorators(fn) else ""
    sig = fn.name if kind else _signature(fn, method=bool(prefix))
    head = f"{level} {kind}`{prefix}{fn.name}`"
    return [head, "", "```py", prefix + sig, "```", "", *_doc(fn)]


def _class(cls: ast.ClassDef) -> list[str]:
    bases = ", ".join(ast.unparse(b) for b in cls.bases)
    lines = [f"### class `{cls.name}`" + (f" ({bases})" if bases else ""), ""]
    init = next((n for n in cls.body
                 if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None:
        sig = _signature(init, method=True).replace("__init__", cls.name, 1)
        lines += ["```py", sig.removesuffix(" -> None"), "```", ""]
    lines += _doc(cls)
    for node in cls.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("_") or any(d.endswith(".setter") for d in _decorators(node)):
            continue
        if node.name in PROTOCOL and not ast.get_docstring(node):
            continue  # an undocumented nn.Module.forward says nothing new
        lines += _function(node, f"{cls.name}.", "####")
    return lines


def _find(module: str, name: str, seen: frozenset[str] = frozenset()) -> tuple[str, ast.AST] | None:
    """The node that defines ``name`` in ``module`` (following ``from .x import name``)."""
    tree = ast.parse(_path(module).read_text())
    for node in _statements(tree.body):
        defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if (isinstance(node, defs) and node.name == name) or _assigns(node, name):
            return module, node
    for node in _statements(tree.body):
        imported = isinstance(node, ast.ImportFrom) and node.level \
            and any(a.name == name for a in node.names)
        if imported:
            parts = module.split(".")
            if _path(module).name != "__init__.py":
                parts = parts[:-1]  # a module's relative imports start at its package
            package = ".".join(parts[: len(parts) - (node.level - 1)])
            target = f"{package}.{node.module}" if node.module else package
            if target not in seen and _path(target).exists():
                return _find(target, name, seen | {module})
    return None


def _entry(module: str, name: str) -> list[str]:
    found = _find(module, name)
    if found is None:
        return [f"### `{name}`", "", "*(not found in the source)*", ""]
    where, node = found
    note = [f"Defined in `{where}`.", ""] if where != module else []
    if isinstance(node, ast.ClassDef):
        lines = _class(node)
        return lines[:2] + note + lines[2:]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = _function(node, "", "###")
        return lines[:2] + note + lines[2:]
    value = ast.unparse(node.value)  # type: ignore[attr-defined]
    if len(value) > WIDTH:
        value = value[: WIDTH - 3] + "..."
    return [f"### `{name}`", "", *note, "```py", f"{name} = {value}", "```", ""]


def render() -> str:
    """The whole of docs/api.md."""
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand",
        "(`tests/test_docs_api.py` checks that it is up to date). Top-level names",
        "(`layeropt.Adam`, `layeropt.attach`, ...) are listed in the module that defines them.",
        "",
    ]
    top = _all(ast.parse(_path("layeropt").read_text()))
    lines += ["Top level: " + ", ".join(f"`layeropt.{n}`" for n in top), ""]
    lines += ["Modules:", ""] + [f"- [`{m}`](#{m.replace('.', '')})" for m in MODULES] + [""]
    for module in MODULES:
        tree = ast.parse(_path(module).read_text())
        doc = ast.get_docstring(tree, clean=True) or ""
        first = doc.split("\n\n")[0].replace("\n", " ")
        source = _path(module).relative_to(ROOT).as_posix()
        lines += [f"## {module}", "", first, "", f"Source: `{source}`.", ""]
        for name in _all(tree):
            lines += _entry(module, name)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/api.md from the docstrings.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        stale = not OUT.exists() or OUT.read_text() != text
        if stale:
            print("docs/api.md is out of date: run python docs/gen_api.py", file=sys.stderr)
        return int(stale)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
