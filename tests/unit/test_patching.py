"""The patch helper: originals kept, no double patching, lazy application."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_overlay.core.patching import Patch, PatchRegistry, unit_skips

ENTRY = dict(why="w", upstream="u", removal="r")


@pytest.fixture
def fake_module():
    module = types.ModuleType("overlay_fake_target")

    class Target:
        @staticmethod
        def order():
            return "stock"

        def method(self):
            return "stock method"

    class Child(Target):
        pass

    module.Target, module.Child = Target, Child
    module.VALUE = 1
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_replace_keeps_original_and_undo_restores(fake_module):
    registry = PatchRegistry()
    new = staticmethod(lambda: "patched")
    state = registry.add(
        Patch(
            id="T-1",
            module=fake_module.__name__,
            target="Target.order",
            new=new,
            **ENTRY,
        )
    )
    assert state.status == "applied" and state.detail == "replaced"
    assert fake_module.Target.order() == "patched"
    assert fake_module.Child.order() == "patched"
    assert registry.original("T-1")() == "stock"
    registry.undo("T-1")
    assert fake_module.Target.order() == "stock"
    assert isinstance(vars(fake_module.Target)["order"], staticmethod)


def test_original_of_a_replacement_shared_by_patch_sets(fake_module):
    """A replacement shared by two releases' patch sets (each its own id)
    finds upstream's attribute by itself: only one set is applied."""
    registry = PatchRegistry()
    new = staticmethod(lambda: "patched")
    with pytest.raises(LookupError, match="0 applied patches"):
        registry.original_of(new)
    registry.add(
        Patch(
            id="T-6",
            module=fake_module.__name__,
            target="Target.order",
            new=new,
            **ENTRY,
        )
    )
    registry.add(
        Patch(id="T-7", module="not.imported.yet", target="order", new=new, **ENTRY)
    )  # pending: not applied, so not a second candidate
    assert registry.original_of(new)() == "stock"
    registry.undo("T-6")
    with pytest.raises(LookupError):
        registry.original_of(new)


def test_shadowing_an_inherited_attribute_is_an_addition(fake_module):
    registry = PatchRegistry()
    state = registry.add(
        Patch(
            id="T-2",
            module=fake_module.__name__,
            target="Child.method",
            new=lambda self: "child",
            **ENTRY,
        )
    )
    assert state.detail == "added"
    assert fake_module.Child().method() == "child"
    assert fake_module.Target().method() == "stock method"
    registry.undo("T-2")
    assert "method" not in vars(fake_module.Child)
    assert fake_module.Child().method() == "stock method"


def test_same_patch_twice_is_a_no_op_other_patch_same_target_refused(fake_module):
    registry = PatchRegistry()
    patch = Patch(id="T-3", module=fake_module.__name__, target="VALUE", new=2, **ENTRY)
    first = registry.add(patch)
    assert registry.add(patch) is first  # re-entrant
    assert fake_module.VALUE == 2 and registry.original("T-3") == 1
    with pytest.raises(RuntimeError, match="already patched by T-3"):
        registry.add(
            Patch(id="T-4", module=fake_module.__name__, target="VALUE", new=3, **ENTRY)
        )
    with pytest.raises(RuntimeError, match="different contents"):
        registry.add(
            Patch(id="T-3", module=fake_module.__name__, target="VALUE", new=4, **ENTRY)
        )
    assert fake_module.VALUE == 2


def test_missing_target_is_reported_not_raised(fake_module):
    registry = PatchRegistry()
    state = registry.add(
        Patch(
            id="T-5", module=fake_module.__name__, target="Nope.method", new=1, **ENTRY
        )
    )
    assert state.status == "failed" and "Nope" in state.detail


def test_a_gone_module_level_target_fails_loudly(fake_module, caplog):
    """A module-level patch replaces: its target gone (upstream renamed the
    function) is a failure, logged as an error naming the feature, never
    an "added" attribute nobody calls."""
    registry = PatchRegistry()
    with caplog.at_level("ERROR", logger="vllm.overlay"):
        state = registry.add(
            Patch(
                id="T-9",
                module=fake_module.__name__,
                target="build_config",
                new=lambda: None,
                feature="a feature",
                **ENTRY,
            )
        )
    assert state.status == "failed"
    assert "has no attribute 'build_config'" in state.detail
    assert not hasattr(fake_module, "build_config")
    assert registry.failed() == [state]
    assert "patch T-9" in caplog.text and "uses a feature is refused" in caplog.text


def test_skipped_patch_is_recorded_and_not_applied(fake_module):
    registry = PatchRegistry()
    state = registry.add(
        Patch(id="T-6", module=fake_module.__name__, target="VALUE", new=9, **ENTRY),
        skip_reason="by request",
    )
    assert (state.status, state.detail) == ("skipped", "by request")
    assert fake_module.VALUE == 1


def test_skipping_one_patch_of_a_unit_skips_the_whole_unit(fake_module):
    """A unit (``Patch.unit``, here declared by U-1 only, as OF32-04/06
    declare OF32-04/05/06) is skipped whole when one of its patches is; a
    patch outside it is not; the registry answers each member's unit."""
    unit = ("U-1", "U-2", "U-3")
    patches = [
        Patch(
            id="U-1",
            module=fake_module.__name__,
            target="Target.order",
            new=staticmethod(lambda: "patched"),
            unit=unit,
            **ENTRY,
        ),
        Patch(
            id="U-2",
            module=fake_module.__name__,
            target="Target.method",
            new=lambda self: "patched",
            **ENTRY,
        ),
        Patch(id="U-3", module=fake_module.__name__, target="VALUE", new=9, **ENTRY),
        Patch(
            id="A-1", module=fake_module.__name__, target="Child.extra", new=1, **ENTRY
        ),
    ]
    with_u2 = "by env with U-2 (one unit: U-1, U-2, U-3)"
    assert unit_skips(patches, ["U-2"], "by env") == {
        "U-2": "by env",
        "U-1": with_u2,
        "U-3": with_u2,
    }
    assert unit_skips(patches, ["U-1", "U-3"], "by env") == {
        "U-1": "by env",
        "U-3": "by env",
        "U-2": "by env with U-1, U-3 (one unit: U-1, U-2, U-3)",
    }
    assert unit_skips(patches, ["A-1"], "by env") == {"A-1": "by env"}
    assert unit_skips(patches, [], "by env") == {}
    registry = PatchRegistry()
    skips = unit_skips(patches, ["U-3"], "by env")
    states = [registry.add(p, skip_reason=skips.get(p.id)) for p in patches]
    assert [s.status for s in states] == ["skipped"] * 3 + ["applied"]
    assert fake_module.Target.order() == "stock" and fake_module.VALUE == 1
    assert [registry.unit(pid) for pid in ("U-1", "U-2", "U-3")] == [unit] * 3
    assert registry.unit("A-1") == ()


def test_patch_applies_when_its_module_is_first_imported(tmp_path, monkeypatch):
    (tmp_path / "overlay_lazy_target.py").write_text(
        "class C:\n    def f(self):\n        return 'stock'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = PatchRegistry()
    state = registry.add(
        Patch(
            id="T-7",
            module="overlay_lazy_target",
            target="C.f",
            new=lambda self: "patched",
            **ENTRY,
        )
    )
    assert state.status == "pending"
    assert "overlay_lazy_target" not in sys.modules
    try:
        import overlay_lazy_target

        assert state.status == "applied"
        assert overlay_lazy_target.C().f() == "patched"
        # The module keeps its real loader.
        assert type(overlay_lazy_target.__loader__).__name__ != "_HookedLoader"
    finally:
        sys.modules.pop("overlay_lazy_target", None)


def test_catalogue_fields_are_required():
    with pytest.raises(ValueError, match="'why' is empty"):
        Patch(
            id="T-8", module="m", target="t", new=1, why="", upstream="u", removal="r"
        )
