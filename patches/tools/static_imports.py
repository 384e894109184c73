"""Static resolution of ``vllm`` imports against a source tree (an
extracted sdist, with staged new files over it): what a module imports,
and whether each ``from vllm... import X`` resolves (the module file exists
and binds ``X``: a definition, an assignment, an import, a star import of a
module that does, or a submodule).  Nothing is imported or run.
"""

from __future__ import annotations

import ast
import pathlib


def module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


class Tree:
    """A source tree's files (ROOT), with staged new files (path -> text)
    over them."""

    def __init__(self, root: pathlib.Path, staged: dict[str, str]) -> None:
        self.root = root
        self.staged = staged

    def text(self, path: str) -> str | None:
        if path in self.staged:
            return self.staged[path]
        file = self.root / path
        return file.read_text() if file.is_file() else None

    def module_path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if self.text(path) is not None:
                return path
        return None


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _absolute(module: str | None, level: int, path: str) -> str:
    if not level:
        return module or ""
    package = module_of(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def bound_names(tree: Tree, path: str, seen: set[str] | None = None) -> set[str]:
    """Names the module file PATH binds at its top level (if/try included),
    through star imports too; the ``__all__`` of a module with ``__getattr__``."""
    seen = seen if seen is not None else set()
    if path in seen:
        return set()
    seen.add(path)
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(_names(target))
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                names.update(_names(node.target))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name != "*":
                        names.add(alias.asname or alias.name)
                        continue
                    module = _absolute(node.module, node.level, path)
                    star = tree.module_path(module)
                    if star is not None:
                        names.update(exported(tree, star, seen))
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    module = ast.parse(tree.text(path) or "")
    visit(module.body)
    if "__getattr__" in names:
        names |= _dunder_all(module) or set()
    return names


def _dunder_all(module: ast.Module) -> set[str] | None:
    for node in module.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
        ):
            return {
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            }
    return None


def exported(tree: Tree, path: str, seen: set[str]) -> set[str]:
    """What ``from <module> import *`` takes from the module file PATH."""
    declared = _dunder_all(ast.parse(tree.text(path) or ""))
    if declared is not None:
        return declared
    return {n for n in bound_names(tree, path, seen) if not n.startswith("_")}


def imports(
    text: str, path: str, package: str = "vllm"
) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import of PACKAGE (or a
    module in it) in TEXT, those inside functions included."""
    found = []

    def ours(module: str) -> bool:
        return module == package or module.startswith(package + ".")

    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, path)
            if ours(module):
                found += [(node.lineno, module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if ours(a.name)]
    return found


def vllm_imports(text: str, path: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every vllm import in TEXT."""
    return imports(text, path, "vllm")


def unresolved(tree: Tree, path: str, lines: set[int] | None = None) -> list[str]:
    """The vllm imports of PATH (on LINES only, if given) that do not
    resolve statically in TREE."""
    problems = []
    for line, module, name in vllm_imports(tree.text(path) or "", path):
        if lines is not None and line not in lines:
            continue
        where = f"{path}:{line}: {module}" + (f" import {name}" if name else "")
        module_path = tree.module_path(module)
        if module_path is None:
            problems.append(f"{where}: no module {module}")
        elif name is None or name == "*":
            continue
        elif name not in bound_names(tree, module_path) and (
            tree.module_path(f"{module}.{name}") is None
        ):
            problems.append(f"{where}: {module_path} does not define {name}")
    return problems
