"""The upstream files a touched upstream file depends on, derived from the
reference release's sources (``release_compat.py``), each with why.

Two walks, both static (nothing is imported):

``follow_modules``: from the touched files inside FOLLOWED packages (the
offloading code: ``vllm.v1.kv_offload``, the KV connectors, the block
hashes), every module of those packages they import, transitively.  Those
modules decide what the relied-on code does with the bytes (how ``aggregate``
sums a worker's results, the connector base the offloading connector runs
in, the tier factory, the host region the worker's chunks are views of).
Imports under ``if TYPE_CHECKING:`` are left out (never run), and a name
imported from a package's ``__init__`` is followed to the module the
``__init__`` imports it from (a re-export is not a dependency on every
sibling).

``follow_functions``: from upstream functions the overlay calls for an
identity (``ModelConfig.compute_hash``), the functions they call, in any
``vllm`` module: module-level functions of their own module, methods of
their own class called on ``self``, and functions imported by name (at the
module's top or inside the function).  The files that define them decide
the identity's value.

A reader is what ``release_compat.Sdist`` offers: ``read(rel)`` (bytes or
None) and ``module_file(module)`` (the path of a module, or None).
"""

from __future__ import annotations

import ast
import functools

FUNCTION = ast.FunctionDef | ast.AsyncFunctionDef


def _absolute(module: str | None, level: int, path: str) -> str:
    if not level:
        return module or ""
    package = path.removesuffix(".py").replace("/", ".").split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _walk_run(node: ast.AST):
    """The nodes under NODE, less ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            for other in child.orelse:
                yield other
                yield from _walk_run(other)
            continue
        yield child
        yield from _walk_run(child)


@functools.cache
def _parse(text: bytes) -> ast.Module:
    return ast.parse(text)


class Graph:
    """The import and call facts of one release's sources (READER)."""

    def __init__(self, reader) -> None:
        self.reader = reader

    def tree(self, rel: str) -> ast.Module | None:
        data = self.reader.read(rel)
        return None if data is None else _parse(data)

    def _reexport(self, rel: str, name: str) -> str | None:
        """The module a package ``__init__`` (REL) imports NAME from."""
        tree = self.tree(rel)
        for node in tree.body if tree else ():
            if isinstance(node, ast.ImportFrom) and any(
                (a.asname or a.name) == name for a in node.names
            ):
                return _absolute(node.module, node.level, rel)
        return None

    def resolve(self, module: str, name: str | None) -> str | None:
        """The file that ``from MODULE import NAME`` (``import MODULE``
        without NAME) depends on: a submodule NAME, the module a package
        re-exports NAME from, or MODULE's file."""
        if name:
            sub = self.reader.module_file(f"{module}.{name}")
            if sub is not None:
                return sub
        rel = self.reader.module_file(module)
        if rel is not None and name and rel.endswith("__init__.py"):
            source = self._reexport(rel, name)
            if source and source != module:
                return self.resolve(source, name) or rel
        return rel

    def imports(self, rel: str, node: ast.AST | None = None) -> list[tuple[str, str]]:
        """(module, name; "" for ``import M``) of the vllm imports that run
        in REL (under NODE, default the whole file), in source order."""
        found = []
        for child in _walk_run(node if node is not None else self.tree(rel)):
            if isinstance(child, ast.ImportFrom):
                module = _absolute(child.module, child.level, rel)
                found += [(module, a.name) for a in child.names]
            elif isinstance(child, ast.Import):
                found += [(a.name, "") for a in child.names]
        return [(m, n) for m, n in found if m == "vllm" or m.startswith("vllm.")]

    def bindings(self, rel: str) -> dict[str, tuple[str, str]]:
        """Top-level ``from M import N [as A]`` of REL: A -> (M, N)."""
        out = {}
        for child in _walk_run(self.tree(rel)):
            if isinstance(child, ast.ImportFrom):
                module = _absolute(child.module, child.level, rel)
                for alias in child.names:
                    out[alias.asname or alias.name] = (module, alias.name)
        return out

    def function(self, rel: str, qualname: str) -> ast.AST | None:
        """The definition of QUALNAME (``f`` or ``Class.f``) in REL."""
        scope: list[ast.stmt] = self.tree(rel).body if self.tree(rel) else []
        node = None
        for part in qualname.split("."):
            node = next(
                (
                    n
                    for n in scope
                    if isinstance(n, FUNCTION | ast.ClassDef) and n.name == part
                ),
                None,
            )
            if node is None:
                return None
            scope = node.body
        return node


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def follow_modules(
    reader, touched: list[str], packages: tuple[str, ...]
) -> dict[str, str]:
    """The files of PACKAGES (module prefixes) that the TOUCHED files in
    them import, transitively, not TOUCHED themselves -> why."""
    graph = Graph(reader)

    def module_of(rel: str) -> str:
        return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")

    todo = sorted(rel for rel in touched if _within(module_of(rel), packages))
    seen, found = set(touched), {}
    while todo:
        rel = todo.pop(0)
        for module, name in graph.imports(rel):
            dep = graph.resolve(module, name or None)
            if dep is None or dep in seen or not _within(module_of(dep), packages):
                continue
            seen.add(dep)
            found[dep] = f"imported by {rel} (runs with it)"
            todo.append(dep)
    return found


def follow_functions(reader, functions: dict[str, str]) -> dict[str, str]:
    """The files defining what FUNCTIONS (``"path:Qual.name"`` -> why)
    call, transitively (see the module docstring), not FUNCTIONS' own
    files -> why."""
    graph = Graph(reader)
    own = {key.split(":", 1)[0] for key in functions}
    found: dict[str, str] = {}
    caller: dict[str, str] = {}
    todo, done = sorted(functions), set()
    while todo:
        key = todo.pop(0)
        done.add(key)
        rel, qualname = key.split(":", 1)
        node = graph.function(rel, qualname)
        if node is None:
            raise SystemExit(f"{rel} defines no {qualname} (a relied-on function)")
        if rel not in own and rel not in found:
            found[rel] = f"defines {qualname}, called by {caller[key]}"
        for callee in _callees(graph, rel, qualname, node):
            if callee not in done and callee not in todo:
                caller[callee] = f"{rel}:{qualname}"
                todo.append(callee)
    return found


def _callees(graph: Graph, rel: str, qualname: str, node: ast.AST) -> list[str]:
    """``"path:Qual.name"`` of what NODE calls that the walk follows."""
    walked = list(_walk_run(node))
    names = {
        n.id for n in walked if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    methods = {
        n.attr
        for n in walked
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }
    bound = graph.bindings(rel)
    bound.update({name: (module, name) for module, name in graph.imports(rel, node)})
    out = []
    for name in sorted(names):
        if name in bound:
            module, imported = bound[name]
            dep = graph.resolve(module, None)
            if dep is not None and dep.endswith("__init__.py"):
                dep = graph.resolve(module, imported)
            if dep is not None and graph.function(dep, imported) is not None:
                out.append(f"{dep}:{imported}")
        elif graph.function(rel, name) is not None:
            out.append(f"{rel}:{name}")
    owner = qualname.rsplit(".", 1)[0] if "." in qualname else None
    for method in sorted(methods):
        if owner and graph.function(rel, f"{owner}.{method}") is not None:
            out.append(f"{rel}:{owner}.{method}")
    return out
