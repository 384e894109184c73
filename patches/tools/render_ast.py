"""What the renderers of a runtime patch (render_patch.py, and
render_wrapper.py for wrappers) both read of a function's source: where its
signature and docstring end, its parameters, a span of its lines; the
marker of runtime-only lines and the error that refuses a patch."""

from __future__ import annotations

import ast
import io
import re
import tokenize

RUNTIME_ONLY = re.compile(
    r"^[ \t]*# runtime only: begin.*?^[ \t]*# runtime only: end\n", re.M | re.S
)


class RenderError(SystemExit):
    pass


def signature_end(lines: list[str], node: ast.FunctionDef) -> int:
    """The 1-based line of the colon that ends NODE's signature."""
    text = "".join(lines[node.lineno - 1 : node.end_lineno])
    depth, seen_def = 0, False
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and tok.string == "def":
            seen_def = True
        elif tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        elif seen_def and depth == 0 and tok.type == tokenize.OP and tok.string == ":":
            return node.lineno + tok.start[0] - 1
    raise RenderError(f"no end of signature for {node.name}")


def docstring_end(node: ast.FunctionDef) -> int | None:
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.end_lineno
    return None


def top_level_def(module: ast.Module, name: str) -> ast.FunctionDef:
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise RenderError(f"the patch module has no top-level def {name}")


def param_names(node: ast.FunctionDef) -> list[str]:
    a = node.args
    return [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]] + [
        f"*{x.arg}" for x in (a.vararg, a.kwarg) if x is not None
    ]


def line_span(lines: list[str], start: int, end: int, drop: set[int]) -> str:
    """Lines START..END (1-based, inclusive) without the lines in DROP."""
    return "".join(lines[i - 1] for i in range(start, end + 1) if i not in drop)
