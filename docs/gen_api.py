"""Generate ``docs/api.md``, the API reference, from layeropt's docstrings.

The sources are parsed, not imported, so the output is the same whatever is
installed (torch version, transformers or not). Each module in ``PUBLIC`` is
listed with the first paragraph of its docstring, then every name in its
``__all__`` (less ``NOT_API``): signature and full docstring (public methods
and properties of classes too; a constant's docstring is its ``#:`` comment).
An object re-exported by several public modules is listed once, under the
first (``layeropt.two_pass_compile``, not ``layeropt.integrations``'s).
``tests/test_docs_api.py`` fails when ``docs/api.md`` is out of date, when an
entry has no docstring or no definition in the source (a submodule missing
from ``PUBLIC``), when a public name reachable from ``import layeropt`` is not
documented, or when an internal name shows up.

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
#: The public modules, in the order of the page: each is listed with the names
#: of its ``__all__``. Modules not here (``layeropt.optim``, ``layeropt.engine.landing``,
#: ``layeropt.demo``, ...) are implementation: what they offer users is
#: re-exported by ``layeropt`` itself, and listed there.
PUBLIC = [
    "layeropt", "layeropt.losses", "layeropt.memory", "layeropt.report",
    "layeropt.distributed", "layeropt.offload", "layeropt.integrations", "layeropt.integrations.hf",
    "layeropt.integrations.lightning", "layeropt.integrations.accelerate", "layeropt.plan",
]  # fmt: skip
#: Names in a public module's ``__all__`` that are not API, with the reason.
NOT_API: dict[str, dict[str, str]] = {}  # module -> {name in __all__: why not documented}
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
        return [MISSING, ""]
    return ["```text", doc, "```", ""]


MISSING = "*(no docstring)*"
#: The body of an entry whose name is in an ``__all__`` but defined nowhere in the
#: source: a submodule that belongs in ``PUBLIC``, or a stale name. Never published.
NOT_FOUND = "*(not found in the source)*"


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


def _comment(module: str, node: ast.stmt) -> str:
    """The ``#:`` comment lines right above an assignment (its docstring)."""
    lines = _path(module).read_text().splitlines()[: node.lineno - 1]
    found: list[str] = []
    for line in reversed(lines):
        if not line.strip().startswith("#:"):
            break
        found.insert(0, line.strip()[2:].strip())
    return " ".join(found)


def _wrapped_optimizer(node: ast.stmt) -> str | None:
    """``X`` when ``node`` is ``Name = in_backward(X)`` (a torch class run in backward)."""
    value = getattr(node, "value", None)
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "in_backward" \
            and len(value.args) == 1:
        return ast.unparse(value.args[0])
    return None


def _entry(module: str, name: str) -> list[str]:
    """The lines of one public name, headed by its full name (``module.name``)."""
    full = f"{module}.{name}"
    found = _find(module, name)
    if found is None:
        return [f"### `{full}`", "", NOT_FOUND, ""]
    where, node = found
    if isinstance(node, ast.ClassDef):
        lines = _class(node)
        return [lines[0].replace(f"`{node.name}`", f"`{full}`", 1), *lines[1:]]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = _function(node, "", "###")
        return [f"### `{full}`", *lines[1:]]
    wrapped = _wrapped_optimizer(node)  # type: ignore[arg-type]
    if wrapped is not None:
        # in_backward's own docstring for the class it makes (layeropt/optim.py)
        doc = (f"In-backward {wrapped}: same arguments and math; call "
               "``layeropt.attach(model)`` to update each layer as soon as its gradient "
               f"is complete. Methods: {wrapped}'s and InBackwardOptimizer's.")
        return [f"### class `{full}` (InBackwardOptimizer, {wrapped})", "",
                "```py", f"{name} = in_backward({wrapped})", "```", "",
                "```text", _fill(doc), "```", ""]  # fmt: skip
    value = ast.unparse(node.value)  # type: ignore[attr-defined]
    if len(value) > WIDTH:
        value = value[: WIDTH - 3] + "..."
    doc = _comment(where, node)  # type: ignore[arg-type]
    text = ["```text", _fill(doc), "```", ""] if doc else [MISSING, ""]
    return [f"### `{full}`", "", "```py", f"{name} = {value}", "```", "", *text]


def _fill(text: str) -> str:
    import textwrap

    return textwrap.fill(text, WIDTH - 8)


def _public(module: str) -> list[str]:
    """The module's ``__all__``, less what :data:`NOT_API` names."""
    hidden = NOT_API.get(module, {})
    return [n for n in _all(ast.parse(_path(module).read_text())) if n not in hidden]


def _defined(module: str, name: str) -> tuple[str, str]:
    """Where ``module.name`` is defined: one entry per object, however many re-export it."""
    found = _find(module, name)
    return (found[0], name) if found else (module, name)


def entries() -> list[tuple[str, list[str]]]:
    """``(module, lines)`` for every entry of the page, in order (each object once)."""
    out: list[tuple[str, list[str]]] = []
    first: dict[tuple[str, str], str] = {}
    for module in PUBLIC:
        for name in _public(module):
            if f"{module}.{name}" in PUBLIC:
                continue  # a submodule: it has its own section
            key = _defined(module, name)
            if key in first:
                continue  # re-exported: listed where it is first met
            first[key] = f"{module}.{name}"
            out.append((module, _entry(module, name)))
    return out


def aliases() -> dict[str, str]:
    """``module.name`` -> the full name of its entry, for names listed elsewhere."""
    out: dict[str, str] = {}
    first: dict[tuple[str, str], str] = {}
    for module in PUBLIC:
        for name in _public(module):
            if f"{module}.{name}" in PUBLIC:
                continue
            key = _defined(module, name)
            if key in first:
                out[f"{module}.{name}"] = first[key]
            else:
                first[key] = f"{module}.{name}"
    return out


def not_found() -> list[str]:
    """Entries defined nowhere in the source (a submodule missing from ``PUBLIC``)."""
    return [lines[0].split("`")[1] for _, lines in entries() if NOT_FOUND in lines]


def missing_docstrings() -> list[str]:
    """Entries (and their methods) that have no docstring."""
    missing: list[str] = []
    for _, lines in entries():
        entry = ""
        for i, line in enumerate(lines):
            if line.startswith("#"):
                entry = line.split("`")[1]
            elif line == MISSING:
                missing.append(entry)
    return missing


def _anchor(text: str) -> str:
    """GitHub's anchor of a heading: lower case, only letters, digits, ``-`` and ``_``."""
    return "".join(c for c in text.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def render() -> str:
    """The whole of docs/api.md."""
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand",
        "(`tests/test_docs_api.py` checks that it is up to date). It lists the `__all__` of",
        "each public module, each object once, under its shortest name: `layeropt.Adam`,",
        "not the module that happens to define it. Other modules are implementation.",
        "",
        "Modules:",
        "",
    ]
    lines += [f"- [`{m}`](#{_anchor(m)})" for m in PUBLIC] + [""]
    by_module: dict[str, list[list[str]]] = {}
    for module, entry in entries():
        by_module.setdefault(module, []).append(entry)
    also = aliases()
    for module in PUBLIC:
        tree = ast.parse(_path(module).read_text())
        doc = ast.get_docstring(tree, clean=True) or ""
        first = doc.split("\n\n")[0].replace("\n", " ")
        source = _path(module).relative_to(ROOT).as_posix()
        lines += [f"## {module}", "", first, "", f"Source: `{source}`.", ""]
        subs = [n for n in _public(module) if f"{module}.{n}" in PUBLIC]
        if subs:
            lines += ["Submodules: " + ", ".join(
                f"[`{module}.{n}`](#{_anchor(f'{module}.{n}')})" for n in subs) + ".", ""]
        same = [(n, also[f"{module}.{n}"]) for n in _public(module) if f"{module}.{n}" in also]
        if same:
            lines += ["Also here: " + ", ".join(
                f"`{n}` (the same object as [`{target}`](#{_anchor(target)}))"
                for n, target in same) + ".", ""]
        for entry in by_module.get(module, []):
            lines += entry
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/api.md from the docstrings.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args(argv)
    unknown = not_found()
    if unknown:
        print(f"in an __all__ but defined nowhere in the source: {', '.join(unknown)}; "
              "add a submodule to PUBLIC in docs/gen_api.py, or drop the stale name",
              file=sys.stderr)  # fmt: skip
        return 1
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
