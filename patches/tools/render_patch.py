"""A runtime patch (``Patch``) as an edit of the upstream file it targets.

The convention a patch module follows so its edit renders (checked here;
``patches/README.md``):

* ``Patch.new`` is a function defined with ``def`` at the top level of the
  patch module (``@classmethod``, ``@staticmethod``, ``@property`` allowed),
  with the parameter names of the upstream function ``Patch.target``
  (``Cls.method`` or ``function``).  The edit keeps upstream's decorators,
  signature and docstring and replaces the body with the patch's.  A target
  upstream lacks is added at the end of its class (with the patch's
  decorators).
* Lines from ``# runtime only: begin`` to ``# runtime only: end`` exist only
  because the overlay patches at runtime: dropped.
* A fallback to upstream's code, a top-level ``if COND: return
  REGISTRY.original(ID)(...)`` of the body, renders as ``if not COND:``
  around the rest of the body (which must end with ``return`` or ``raise``),
  followed by upstream's own body unchanged: on the paths the fallback took,
  upstream's code runs as before.
* A wrapper, whose one top-level statement calling upstream's function
  (``REGISTRY.original(ID)(...)`` or ``REGISTRY.original_of(NEW)(...)``,
  or with ``.__func__(cls, ...)``) passes the
  wrapper's own parameters through in order, renders as upstream's body with
  the wrapper's steps written into it:

  - ``return REGISTRY.original(ID)(...)`` last: the statements before it
    go at the top of upstream's body (after its docstring);
  - ``NAME = REGISTRY.original(ID)(...)``, then statements ending in
    ``return``: those statements replace upstream's ``return X``, which
    must be the last statement of its body and its only ``return`` (``NAME``
    is renamed to ``X`` where ``X`` is a name, else ``NAME = X`` first).

  Only parameters upstream has (by name) may be used by the wrapper's own
  statements; upstream's signature is kept.
* An import at the top level of the body whose names the upstream module
  already imports at its top level is dropped.
* Any other use of ``REGISTRY`` does not render: refused.

Names (the overlay's modules and messages) are rewritten by the caller.
"""

from __future__ import annotations

import ast
import textwrap

import render_wrapper
from render_ast import (
    RUNTIME_ONLY,
    RenderError,
    docstring_end,
    line_span,
    param_names,
    signature_end,
    top_level_def,
)


def function_name(new) -> str:
    """The ``def`` name of a patch's replacement."""
    for attr in ("__func__", "fget"):
        new = getattr(new, attr, new)
    return new.__name__


def _find(module: ast.Module, target: str):
    """(class node or None, function node or None) of TARGET."""
    *owner, name = target.split(".")
    scope, cls = module.body, None
    for part in owner:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == part]
        if not found:
            raise RenderError(f"upstream has no class {part} ({target})")
        cls = found[0]
        scope = cls.body
    funcs = [
        n
        for n in scope
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    ]
    return cls, (funcs[0] if funcs else None)


def _top_imports(module: ast.Module) -> set[str]:
    names = set()
    for node in module.body:
        if isinstance(node, ast.ImportFrom | ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


def _is_fallback(node: ast.stmt) -> bool:
    """``if COND: return REGISTRY.original(...)(...)``."""
    if not (isinstance(node, ast.If) and not node.orelse and len(node.body) == 1):
        return False
    ret = node.body[0]
    call = getattr(ret, "value", None)
    return (
        isinstance(ret, ast.Return)
        and isinstance(call, ast.Call)
        and isinstance(call.func, ast.Call)
        and isinstance(call.func.func, ast.Attribute)
        and call.func.func.attr in ("original", "original_of")
        and getattr(call.func.func.value, "id", None) == "REGISTRY"
    )


def _negated(test: ast.expr) -> str:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return ast.unparse(test.operand)
    return f"not ({ast.unparse(test)})"


def patch_body(source: str, name: str, upstream_imports: set[str]):
    """(docstring, before, fallback test, after) of the function NAME in
    SOURCE (a patch module), dedented; fallback None without one."""
    source = RUNTIME_ONLY.sub("", source)
    lines = source.splitlines(keepends=True)
    module = ast.parse(source)
    funcs = [
        n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == name
    ]
    if not funcs:
        raise RenderError(f"the patch module has no top-level def {name}")
    func = funcs[0]
    start = signature_end(lines, func) + 1
    doc_end = docstring_end(func)
    doc = line_span(lines, start, doc_end, set()) if doc_end else ""
    body = [n for n in func.body if doc_end is None or n.lineno > doc_end]
    drop = set()
    for node in body:
        if (
            isinstance(node, ast.ImportFrom | ast.Import)
            and {a.asname or a.name.split(".")[0] for a in node.names}
            <= upstream_imports
        ):
            drop |= set(range(node.lineno, node.end_lineno + 1))
    first = (doc_end + 1) if doc_end else start
    fallbacks = [n for n in body if _is_fallback(n)]
    if not fallbacks:
        text = line_span(lines, first, func.end_lineno, drop)
        return textwrap.dedent(doc), textwrap.dedent(text).lstrip("\n"), None, ""
    fallback = fallbacks[0]
    rest = body[body.index(fallback) + 1 :]
    if not rest or not isinstance(rest[-1], ast.Return | ast.Raise):
        raise RenderError(f"{name}: the body after the fallback must end in return")
    before = line_span(lines, first, fallback.lineno - 1, drop)
    after = line_span(lines, fallback.end_lineno + 1, func.end_lineno, drop)
    return (
        textwrap.dedent(doc),
        textwrap.dedent(before).lstrip("\n"),
        _negated(fallback.test),
        textwrap.dedent(after).lstrip("\n"),
    )


def edit(upstream: str, target: str, source: str, name: str) -> str:
    """UPSTREAM (a file's text) with TARGET's body replaced by the body of
    the function NAME of the patch module SOURCE (the convention above)."""
    tree = ast.parse(upstream)
    lines = upstream.splitlines(keepends=True)
    cls, node = _find(tree, target)
    wrapper = render_wrapper.wrapper_body(source, name, _top_imports(tree))
    if wrapper is not None:
        if node is None:
            raise RenderError(f"{target}: upstream has no such function to wrap")
        return render_wrapper.edit_wrapped(lines, node, wrapper, target)
    doc, before, test, after = patch_body(source, name, _top_imports(tree))
    patch_func = top_level_def(ast.parse(RUNTIME_ONLY.sub("", source)), name)
    if node is None:
        if cls is None or test is not None:
            raise RenderError(f"{target}: upstream has no such function to edit")
        text = RUNTIME_ONLY.sub("", source).splitlines(keepends=True)
        start = min([patch_func.lineno] + [d.lineno for d in patch_func.decorator_list])
        added = "".join(text[start - 1 : patch_func.end_lineno])
        indent = " " * cls.body[0].col_offset
        block = "\n" + textwrap.indent(textwrap.dedent(added), indent)
        at = cls.end_lineno
        return "".join(lines[:at]) + block + "".join(lines[at:])
    if param_names(node) != param_names(patch_func):
        raise RenderError(
            f"{target}: parameters {param_names(patch_func)} differ from "
            f"upstream's {param_names(node)}"
        )
    if "REGISTRY" in before + after:
        raise RenderError(
            f"{target}: the patch calls REGISTRY other than in the fallback "
            "form (if COND: return REGISTRY.original(ID)(...)): a wrapper of "
            "upstream's function does not render (render_patch's docstring)"
        )
    start = signature_end(lines, node) + 1
    doc_end = docstring_end(node)
    indent = " " * node.body[0].col_offset
    old_doc = line_span(lines, start, doc_end, set()) if doc_end else ""
    original = line_span(
        lines, (doc_end + 1) if doc_end else start, node.end_lineno, set()
    )
    if test is None:
        body = textwrap.indent(doc, indent) if doc else old_doc
        body += textwrap.indent(before, indent)
    else:
        body = textwrap.indent(doc, indent) if doc else old_doc
        body += textwrap.indent(before, indent)
        body += f"{indent}if {test}:\n" + textwrap.indent(after, indent + "    ")
        body += original
    return "".join(lines[: start - 1]) + body + "".join(lines[node.end_lineno :])


def imported_from(upstream: str, target: str, path: str) -> str | None:
    """The module a top-level ``from M import TARGET`` of UPSTREAM (the file
    PATH) takes TARGET from, when UPSTREAM does not define it; else None."""
    if "." in target:
        return None
    tree = ast.parse(upstream)
    for node in tree.body:
        if (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and node.name == target
        ):
            return None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(
            (a.asname or a.name) == target and a.name == target for a in node.names
        ):
            package = path.removesuffix(".py").split("/")[:-1]
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                return ".".join(base + ([node.module] if node.module else []))
            return node.module
    return None


def calls(text: str, name: str) -> bool:
    """Whether the code TEXT calls NAME (a name or an attribute)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if getattr(func, "id", None) == name or getattr(func, "attr", None) == name:
                return True
    return False
