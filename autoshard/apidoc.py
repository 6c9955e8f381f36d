"""The API reference, docs/api.md, written from the docstrings: `python -m autoshard.apidoc` rewrites it.

One section per module of the package (found from the files, so a new module appears by itself): its
docstring, then each public class and function defined there with its signature and docstring, a
class's public methods and properties under it. Examples (`>>>`) and indented blocks become code blocks.
The docstring test (tests/test_tutorial.py) checks the same modules, and tests/test_apidoc.py fails when
docs/api.md differs from what `render()` writes, so the page cannot go stale.

    python -m autoshard.apidoc            # rewrite docs/api.md
    python -m autoshard.apidoc --check    # exit 1 when docs/api.md is out of date

>>> print(render(["autoshard.ir.redistribute"]).split("### ")[1].splitlines()[0])
class `Step(op: str, axis: int, dim: int | None = None, to_dim: int | None = None)`
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"


def all_modules() -> list[str]:
    """Every module of the package, by name, from the files under autoshard/ (packages by their __init__).

    >>> names = all_modules()
    >>> names[0], "autoshard.passes.normalize" in names, "autoshard.runtime" in names
    ('autoshard', True, True)
    """
    package = Path(__file__).resolve().parent
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def documented_modules() -> list[str]:
    """The modules the reference covers and the docstring test checks: every module of the package.

    >>> documented_modules() == all_modules()
    True
    """
    return all_modules()


def public_members(module) -> list[tuple[str, object]]:
    """(name, object) of the public classes and functions defined in `module`, in definition order.

    >>> import autoshard.ir.mesh
    >>> [name for name, _ in public_members(autoshard.ir.mesh)]
    ['Mesh']
    """
    return [(name, obj) for name, obj in vars(module).items() if not name.startswith("_") and callable(obj)
            and getattr(obj, "__module__", None) == module.__name__]


def class_members(cls) -> list[tuple[str, object]]:
    """(name, function or property) of a class's public methods and properties, in definition order.

    >>> from autoshard.ir.mesh import Mesh
    >>> [name for name, _ in class_members(Mesh)][:3]
    ['of', 'ndim', 'size']
    """
    out = []
    for name, raw in vars(cls).items():
        raw = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        if not name.startswith("_") and (callable(raw) or isinstance(raw, property)):
            out.append((name, raw))
    return out


def signature(obj) -> str:
    """`(params) -> result` as written in the source (annotations unquoted; a class: its constructor's).

    >>> from autoshard.ir.redistribute import plan_redistribute
    >>> signature(plan_redistribute)
    '(src: Spec, dst: Spec) -> list[Step]'
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # e.g. an exception class without its own __init__
        return "(...)"
    params = [_parameter(p) for p in sig.parameters.values()]
    for i, p in enumerate(sig.parameters.values()):  # the bare `*` and `/` markers
        if p.kind is p.KEYWORD_ONLY and (i == 0 or list(sig.parameters.values())[i - 1].kind
                                          not in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)):
            params[i] = "*, " + params[i]
    text = f"({', '.join(params)})"
    result = sig.return_annotation
    if result is not inspect.Signature.empty and not isinstance(obj, type) and result not in ("None", None):
        text += f" -> {_annotation(result)}"
    return _no_addresses(text)


def _parameter(p: inspect.Parameter) -> str:
    text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
    if p.annotation is not inspect.Parameter.empty:
        text += f": {_annotation(p.annotation)}"
    if p.default is not inspect.Parameter.empty:
        text += (" = " if p.annotation is not inspect.Parameter.empty else "=") + repr(p.default)
    return text


def _annotation(annotation) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def _no_addresses(text: str) -> str:
    """Reprs of defaults must not depend on the process (object addresses)."""
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def docstring_markdown(doc: str | None) -> str:
    """A docstring as markdown: prose as it is, examples (`>>>` and their output) and indented blocks as
    code blocks.

    >>> print(docstring_markdown("Run:\\n    python -m autoshard.demo\\nin a terminal."))
    Run:
    <BLANKLINE>
    ```text
        python -m autoshard.demo
    ```
    <BLANKLINE>
    in a terminal.
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    out, block = [], None  # block: None, "pycon" or "text"
    for line in lines:
        kind = "pycon" if line.lstrip().startswith(">>>") else "text" if line.startswith("  ") else None
        if block == "pycon" and kind is None and line.strip():
            kind = "pycon"  # an example's output
        if kind != block:
            if block is not None:
                out.append("```")
            if kind is not None:
                if out and out[-1].strip():
                    out.append("")
                out.append(f"```{kind}")
            block = kind
        if block is None and out and out[-1] == "```" and line.strip():
            out.append("")
        out.append(line)
    if block is not None:
        out.append("```")
    return "\n".join(out).strip()


def render_module(name: str) -> str:
    """One module's section: its docstring, then its classes (with methods and properties) and functions.

    >>> print(render_module("autoshard.solver.layers").splitlines()[0])
    ## autoshard.solver.layers
    """
    module = importlib.import_module(name)
    parts = [f"## {name}", docstring_markdown(module.__doc__)]
    exports = [e for e in getattr(module, "__all__", ()) if getattr(getattr(module, e, None), "__module__", name)
               not in (name, None)]
    if exports:
        parts.append("Exports: " + ", ".join(f"`{e}` ({getattr(module, e).__module__})" for e in exports))
    for member, obj in public_members(module):
        kind = "class " if isinstance(obj, type) else ""
        parts += [f"### {kind}`{member}{signature(obj)}`", docstring_markdown(obj.__doc__)]
        if isinstance(obj, type):
            for attr, raw in class_members(obj):
                if isinstance(raw, property):
                    parts += [f"#### property `{member}.{attr}`", docstring_markdown(raw.__doc__)]
                else:
                    parts += [f"#### `{member}.{attr}{signature(raw)}`", docstring_markdown(raw.__doc__)]
    return "\n\n".join(p for p in parts if p)


def render(names=None) -> str:
    """The whole page for `names` (default: `documented_modules()`): a contents list, then the sections.

    >>> render(["autoshard.ir.meta"]).splitlines()[:3]
    ['# API reference', '', 'Generated from the docstrings by `python -m autoshard.apidoc`; do not edit by hand.']
    """
    names = documented_modules() if names is None else list(names)
    head = ["# API reference", "",
            "Generated from the docstrings by `python -m autoshard.apidoc`; do not edit by hand.", "",
            "Modules: " + ", ".join(f"[{n}](#{n.replace('.', '').lower()})" for n in names)]
    return "\n".join(head) + "\n\n" + "\n\n".join(render_module(n) for n in names) + "\n"


def main(argv=None) -> int:
    """Write docs/api.md (`--check`: only compare; 1 when it is out of date).

    >>> main(["--check"])  # the committed page is what the docstrings say
    0
    """
    parser = argparse.ArgumentParser(prog="python -m autoshard.apidoc", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is out of date")
    parser.add_argument("--output", default=str(API_PAGE), help="where to write (default: docs/api.md)")
    args = parser.parse_args(argv)
    text = render()
    path = Path(args.output)
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            print(f"{path} is out of date: run python -m autoshard.apidoc", file=sys.stderr)
            return 1
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
