"""The patch helper: one ``Patch`` per replaced or added upstream symbol.

Each patch names its upstream module and a dotted attribute path inside it.
Patches are applied lazily: when the target module is imported (or at once, if
it already is), so registering the overlay never imports heavy vLLM modules
such as the model runner into the front-end process.

The registry keeps every original, refuses to patch one target twice, and
records what happened to each patch (applied / skipped and why / waiting for
its module / failed) for ``python -m vllm_overlay doctor``.  A patch fails
when its target is gone: a class on its path, or a module-level attribute
it replaces (module-level patches replace; only class attributes may be
added).  A failure is logged as an error naming the feature, ``register()``
reports it, and a configuration that needs the feature is refused at
startup (``vllm_overlay.patch_features``).

Some patches work only together (``Patch.unit``: OF32-04/05/06, which
carry a failed transfer from the worker to the scheduler): one of them
alone is worse than none.  Skipping one skips the whole unit
(``unit_skips``), and a configuration that uses their feature is refused
at startup (``PatchRegistry.unit``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("vllm.overlay")

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Patch:
    """One runtime change to one upstream symbol, with its catalogue entry."""

    id: str  # stable id, e.g. "CL-03"; also used by VLLM_OVERLAY_SKIP_PATCHES
    module: str  # upstream module, e.g. "vllm.v1.attention.backends.cpu_attn"
    target: str  # attribute path in the module, e.g. "Cls.method"
    new: Any  # the replacement (or added) attribute, descriptors included
    why: str
    upstream: str  # upstream PR / release that has the same change
    removal: str  # how the patch goes away
    feature: str = "cross-layer KV blocks"
    # The ids of the patches that work only together with this one (itself
    # included); () for a patch that works alone.  A unit may be declared
    # by some of its patches only: it is the union of the declarations.
    unit: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("id", "module", "target", "why", "upstream", "removal"):
            if not getattr(self, field):
                raise ValueError(f"patch {self.id or '?'}: '{field}' is empty")

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.target}"


@dataclasses.dataclass
class PatchState:
    patch: Patch
    status: str = "pending"  # pending | applied | skipped | failed
    detail: str = "waiting for the module to be imported"
    replaced: bool = False  # False: the attribute was added, not replaced
    original: Any = _MISSING
    owned: bool = False  # original lived in the owner's own __dict__


class PatchRegistry:
    def __init__(self) -> None:
        self._states: dict[str, PatchState] = {}
        self._by_symbol: dict[str, str] = {}
        self._lock = threading.RLock()

    # -- registration -------------------------------------------------
    def add(self, patch: Patch, skip_reason: str | None = None) -> PatchState:
        """Register ``patch``; apply it now or when its module is imported.

        Adding the same patch again is a no-op (the plugin is re-entrant);
        a different patch for an already-claimed symbol is an error.
        """
        with self._lock:
            if patch.id in self._states:
                state = self._states[patch.id]
                if state.patch is not patch and state.patch != patch:
                    raise RuntimeError(
                        f"patch id {patch.id} registered twice with different contents"
                    )
                return state
            owner_id = self._by_symbol.get(patch.symbol)
            if owner_id is not None:
                raise RuntimeError(
                    f"{patch.symbol} is already patched by "
                    f"{owner_id}; refusing to patch it again "
                    f"with {patch.id}"
                )
            state = PatchState(patch)
            self._states[patch.id] = state
            self._by_symbol[patch.symbol] = patch.id
            if skip_reason is not None:
                state.status, state.detail = "skipped", skip_reason
                return state
        when_imported(patch.module, lambda module: self._apply(state, module))
        return state

    def _apply(self, state: PatchState, module: Any) -> None:
        with self._lock:
            if state.status == "applied":
                return
            patch = state.patch
            *path, name = patch.target.split(".")
            try:
                owner = module
                for part in path:
                    owner = getattr(owner, part)
            except AttributeError as exc:
                self._fail(state, f"target not found: {exc}")
                return
            if not isinstance(owner, type) and not hasattr(owner, name):
                self._fail(
                    state,
                    f"target not found: {type(owner).__name__} "
                    f"{getattr(owner, '__name__', owner)!r} has no attribute "
                    f"{name!r}",
                )
                return
            if isinstance(owner, type):
                # Replaced only if the class itself defines it; an inherited
                # attribute is shadowed (added), and undo deletes ours.
                state.owned = state.replaced = name in vars(owner)
                state.original = (
                    vars(owner)[name] if state.owned else getattr(owner, name, _MISSING)
                )
            else:
                state.original = getattr(owner, name, _MISSING)
                state.owned = state.replaced = state.original is not _MISSING
            setattr(owner, name, patch.new)
            state.status = "applied"
            state.detail = "replaced" if state.replaced else "added"
            logger.debug(
                "vllm-overlay: %s %s (%s)", state.detail, patch.symbol, patch.id
            )

    @staticmethod
    def _fail(state: PatchState, detail: str) -> None:
        patch = state.patch
        state.status, state.detail = "failed", detail
        logger.error(
            "vllm-overlay: patch %s (%s) did not apply: %s; a configuration "
            "that uses %s is refused at startup",
            patch.id,
            patch.symbol,
            detail,
            patch.feature,
        )

    # -- queries --------------------------------------------------------
    def states(self) -> list[PatchState]:
        with self._lock:
            return list(self._states.values())

    def failed(self) -> list[PatchState]:
        """The patches whose target was gone when their module loaded."""
        return [state for state in self.states() if state.status == "failed"]

    def state(self, patch_id: str) -> PatchState:
        return self._states[patch_id]

    def unit(self, patch_id: str) -> tuple[str, ...]:
        """The registered patches that work only together with PATCH_ID,
        itself included, in id order (``()``: it works alone)."""
        with self._lock:
            found = set()
            for state in self._states.values():
                if patch_id in state.patch.unit:
                    found.update(state.patch.unit)
        return tuple(sorted(found))

    def original(self, patch_id: str) -> Any:
        """The upstream attribute a patch replaced (raises if none)."""
        state = self._states[patch_id]
        if state.original is _MISSING:
            raise LookupError(
                f"patch {patch_id} has no original ({state.status}: {state.detail})"
            )
        return state.original

    def original_of(self, new: Any) -> Any:
        """The upstream attribute replaced by the applied patch whose
        replacement is NEW: for a replacement that the patch sets of
        several releases share (each set names its own patch id)."""
        with self._lock:
            ids = [
                patch_id
                for patch_id, state in self._states.items()
                if state.patch.new is new and state.status == "applied"
            ]
        if len(ids) != 1:
            raise LookupError(f"{len(ids)} applied patches replace with {new!r}: {ids}")
        return self.original(ids[0])

    def undo(self, patch_id: str) -> None:
        """Restore one original (used by tests of the helper itself)."""
        with self._lock:
            state = self._states.pop(patch_id)
            self._by_symbol.pop(state.patch.symbol, None)
            if state.status != "applied":
                return
            patch = state.patch
            *path, name = patch.target.split(".")
            owner = sys.modules[patch.module]
            for part in path:
                owner = getattr(owner, part)
            if state.owned:
                setattr(owner, name, state.original)
            else:
                delattr(owner, name)


def unit_skips(patches: Iterable[Patch], skipped: Iterable[str], by: str) -> dict:
    """Patch id -> why it is skipped: BY for each id in SKIPPED, and every
    other patch of a unit (``Patch.unit``) that one of them is in, saying
    which skipped id took it along."""
    patches, skipped = list(patches), set(skipped)
    out = {pid: by for pid in skipped}
    for patch in patches:
        unit = {pid for p in patches if patch.id in p.unit for pid in p.unit}
        with_ids = sorted(unit & skipped)
        if patch.id not in skipped and with_ids:
            out[patch.id] = (
                f"{by} with {', '.join(with_ids)} (one unit: {', '.join(sorted(unit))})"
            )
    return out


# ---------------------------------------------------------------------------
# Post-import hooks: run a callback right after a module finishes executing.

_hooks: dict[str, list[Callable[[Any], None]]] = {}
_hooks_lock = threading.RLock()


def when_imported(module_name: str, callback: Callable[[Any], None]) -> None:
    """Call ``callback(module)`` now if imported, else right after import."""
    with _hooks_lock:
        module = sys.modules.get(module_name)
        if module is None:
            _hooks.setdefault(module_name, []).append(callback)
            _install_finder()
            return
    callback(module)


def _run_hooks(module: Any) -> None:
    with _hooks_lock:
        callbacks = _hooks.pop(module.__name__, [])
    for callback in callbacks:
        callback(module)


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):  # noqa: D401 - importlib protocol
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # Leave the real loader on the module (reload, inspect, pkgutil).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_hooks(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


_finder = _PostImportFinder()


def _install_finder() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def import_target(module_name: str) -> str | None:
    """Import a patch target module; return why it cannot be, or None."""
    try:
        importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - reported by doctor
        return f"{type(exc).__name__}: {exc}"
    return None


REGISTRY = PatchRegistry()
