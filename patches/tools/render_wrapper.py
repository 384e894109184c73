"""A wrapper patch (one that calls upstream's function once, passing its
own parameters through) as an edit of upstream's function: the wrapper's
steps before the call open upstream's body, those after it replace
upstream's only ``return`` (``render_patch``'s docstring has the
convention).  Used by ``render_patch.edit``."""

from __future__ import annotations

import ast
import dataclasses
import io
import textwrap
import tokenize

from render_ast import (
    RUNTIME_ONLY,
    RenderError,
    docstring_end,
    line_span,
    param_names,
    signature_end,
    top_level_def,
)


def _original_call(node: ast.AST) -> ast.Call | None:
    """NODE as ``REGISTRY.original(ID)(...)`` or
    ``REGISTRY.original(ID).__func__(...)``, else None."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "__func__":
        func = func.value
    if (
        isinstance(func, ast.Call)
        and isinstance(func.func, ast.Attribute)
        and func.func.attr in ("original", "original_of")
        and getattr(func.func.value, "id", None) == "REGISTRY"
    ):
        return node
    return None


def _passes_through(call: ast.Call, func: ast.FunctionDef) -> bool:
    """CALL passes FUNC's parameters through, in order and unchanged."""
    a = func.args
    want = [x.arg for x in [*a.posonlyargs, *a.args]]
    got = []
    for arg in call.args:
        if isinstance(arg, ast.Name):
            got.append(arg.id)
        elif isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
            got.append("*" + arg.value.id)
        else:
            return False
    if a.vararg is not None:
        want.append("*" + a.vararg.arg)
    kwargs = [(k.arg, getattr(k.value, "id", None)) for k in call.keywords]
    want_kwargs = [(x.arg, x.arg) for x in a.kwonlyargs]
    if a.kwarg is not None:
        want_kwargs.append((None, a.kwarg.arg))
    return got == want and kwargs == want_kwargs


@dataclasses.dataclass
class Wrapper:
    """A patch that calls upstream's function once (the convention)."""

    docstring: str
    before: str  # statements before the call (dedented)
    after: str  # statements after it, ending in return ("" when none)
    result: str | None  # the name the call's result is bound to
    names: set[str]  # the names the wrapper's own statements use
    params: list[str]  # the wrapper's parameters


def _uses(nodes: list[ast.stmt]) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def wrapper_body(source: str, name: str, upstream_imports: set[str]):
    """The function NAME of SOURCE as a ``Wrapper``, or None when it does
    not call upstream's function."""
    source = RUNTIME_ONLY.sub("", source)
    lines = source.splitlines(keepends=True)
    func = top_level_def(ast.parse(source), name)
    doc_end = docstring_end(func)
    body = [n for n in func.body if doc_end is None or n.lineno > doc_end]
    calls = [
        i
        for i, node in enumerate(body)
        if isinstance(node, ast.Return | ast.Assign)
        and _original_call(node.value) is not None
    ]
    if not calls:
        return None
    if len(calls) > 1:
        raise RenderError(f"{name}: calls upstream's function more than once")
    at = calls[0]
    stmt = body[at]
    if not _passes_through(stmt.value, func):
        raise RenderError(
            f"{name}: the call of upstream's function must pass the "
            "wrapper's parameters through, in order and unchanged"
        )
    before, after = body[:at], body[at + 1 :]
    if isinstance(stmt, ast.Return):
        result = None
        if after:
            raise RenderError(f"{name}: statements after the returned call")
    else:
        if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
            raise RenderError(f"{name}: bind upstream's result to one name")
        result = stmt.targets[0].id
        if not after or not isinstance(after[-1], ast.Return):
            raise RenderError(f"{name}: the wrapper must end in return")
    if "REGISTRY" in _uses(before + after):
        raise RenderError(f"{name}: uses REGISTRY other than in the one call")
    drop = set()
    for node in before + after:
        if (
            isinstance(node, ast.ImportFrom | ast.Import)
            and {a.asname or a.name.split(".")[0] for a in node.names}
            <= upstream_imports
        ):
            drop |= set(range(node.lineno, node.end_lineno + 1))

    def text(nodes: list[ast.stmt]) -> str:
        if not nodes:
            return ""
        span = line_span(lines, nodes[0].lineno, nodes[-1].end_lineno, drop)
        return textwrap.dedent(span).lstrip("\n")

    start = signature_end(lines, func) + 1
    doc = textwrap.dedent(line_span(lines, start, doc_end, set())) if doc_end else ""
    used = _uses(before + after) - ({result} if result else set())
    params = [p.lstrip("*") for p in param_names(func)]
    return Wrapper(doc, text(before), text(after), result, used, params)


def _rename(text: str, old: str, new: str) -> str:
    """TEXT with the variable OLD named NEW (not attributes or keywords)."""
    lines = text.splitlines(keepends=True)
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type not in (tokenize.NL, tokenize.COMMENT)
    ]
    at = []
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.NAME or tok.string != old:
            continue
        prev = tokens[i - 1].string if i else ""
        following = tokens[i + 1].string if i + 1 < len(tokens) else ""
        if prev == ".":
            continue
        if following == "=" and prev in ("(", ","):
            raise RenderError(f"{old} is also a keyword argument: rename it")
        at.append(tok.start)
    for row, col in reversed(at):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old) :]
    return "".join(lines)


def _returns(node: ast.FunctionDef) -> list[ast.Return]:
    """NODE's own return statements (not those of nested scopes)."""
    found, todo = [], list(node.body)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Return):
            found.append(n)
        if isinstance(
            n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
        ):
            continue
        todo.extend(ast.iter_child_nodes(n))
    return found


def edit_wrapped(lines, node, wrapper: Wrapper, target: str) -> str:
    """Upstream's function NODE (in LINES) with WRAPPER's steps written in."""
    params = {p.lstrip("*") for p in param_names(node)}
    foreign = wrapper.names & (set(wrapper.params) - params)
    if foreign:
        raise RenderError(
            f"{target}: the wrapper uses {sorted(foreign)}, which "
            "upstream's function does not take"
        )
    start = signature_end(lines, node) + 1
    doc_end = docstring_end(node)
    indent = " " * node.body[0].col_offset
    first = (doc_end + 1) if doc_end else start
    head = (
        textwrap.indent(wrapper.docstring, indent)
        if wrapper.docstring
        else line_span(lines, start, doc_end, set())
        if doc_end
        else ""
    )
    head += textwrap.indent(wrapper.before, indent)
    if not wrapper.after:
        body = line_span(lines, first, node.end_lineno, set())
        return (
            "".join(lines[: start - 1])
            + head
            + body
            + "".join(lines[node.end_lineno :])
        )
    last = node.body[-1]
    returns = _returns(node)
    if not (isinstance(last, ast.Return) and returns == [last] and last.value):
        raise RenderError(
            f"{target}: upstream's function must end in its only return "
            "(a wrapper's statements after the call go there)"
        )
    after = wrapper.after
    if isinstance(last.value, ast.Name):
        after = _rename(after, wrapper.result, last.value.id)
    else:
        if wrapper.result in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}:
            raise RenderError(f"{target}: upstream already uses {wrapper.result}")
        value = ast.get_source_segment("".join(lines), last.value)
        after = f"{wrapper.result} = {value}\n" + after
    body = line_span(lines, first, last.lineno - 1, set())
    body += textwrap.indent(after, indent)
    return "".join(lines[: start - 1]) + head + body + "".join(lines[node.end_lineno :])
