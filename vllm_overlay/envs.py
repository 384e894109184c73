"""Every environment variable the overlay reads, in one table."""

from __future__ import annotations

import dataclasses
import os

from vllm_overlay.version_gate import supported_text


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    example: str  # the value the README's table shows
    help: str  # what that value does (Markdown, one table cell)

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)

    def flag(self) -> bool:
        value = self.raw().strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("", "0", "false", "no", "off"):
            return False
        raise ValueError(
            f"{self.name}={self.raw()!r}: expected 0/1, true/false, yes/no or on/off"
        )

    def items(self) -> list[str]:
        return [part.strip() for part in self.raw().split(",") if part.strip()]


DISABLE = EnvVar(
    "VLLM_OVERLAY_DISABLE", "0", "1", "the plugin does nothing (stock vLLM)"
)
STRICT = EnvVar(
    "VLLM_OVERLAY_STRICT",
    "0",
    "1",
    f"a vLLM other than {supported_text()} is an error (default: one warning, "
    "nothing patched)",
)
SKIP_PATCHES = EnvVar(
    "VLLM_OVERLAY_SKIP_PATCHES",
    "",
    "CL-06,...",
    "leave these patches out (ids in [PATCHES.md](PATCHES.md))",
)

ALL = (DISABLE, STRICT, SKIP_PATCHES)


def env_features() -> list[str]:
    """The overlay's environment switches set to something only the overlay
    can do (``VLLM_OVERLAY_DISABLE=1`` asks for stock vLLM: not one)."""
    found = []
    if STRICT.flag():
        found.append(f"{STRICT.name}={STRICT.raw()}")
    if SKIP_PATCHES.items():
        found.append(f"{SKIP_PATCHES.name}={SKIP_PATCHES.raw()}")
    return found


class BadSetting(ValueError):
    """An overlay variable set to something it cannot take; uncaught, it
    prints as its one line (``startup_errors``)."""

    one_line_startup_error = True


def skip_patches_error(entry: str, known: list[str]) -> str | None:
    """The error for ids in ``VLLM_OVERLAY_SKIP_PATCHES`` that are not in
    KNOWN, the ids of release ENTRY's patch set (None: all are): an id of
    another release's set names that release, and this set's ids are
    listed."""
    unknown = [pid for pid in SKIP_PATCHES.items() if pid not in known]
    if not unknown:
        return None
    from vllm_overlay.patches import all_patches
    from vllm_overlay.version_gate import RELEASES

    owner: dict[str, str] = {}
    for other, patch_set in RELEASES.items():
        if patch_set != RELEASES[entry]:
            for patch in all_patches(other):
                owner.setdefault(patch.id, other)
    nowhere = [pid for pid in unknown if pid not in owner]
    parts = [f"unknown patch ids {nowhere}"] if nowhere else []
    parts += [
        f"{pid} is a patch of vLLM {owner[pid]}" for pid in unknown if pid in owner
    ]
    return (
        f"{SKIP_PATCHES.name}={SKIP_PATCHES.raw()}: {'; '.join(parts)}. "
        f"This vLLM's patch set ({RELEASES[entry]}, vLLM {entry}) has: "
        f"{', '.join(known)}"
    )


def cross_layer_patches_on() -> bool:
    """Whether this process may allocate cross-layer blocks: the plugin is
    on and its layout patches (CL-09, CL-10) are not skipped."""
    return not DISABLE.flag() and not {"CL-09", "CL-10"} & set(SKIP_PATCHES.items())


def markdown_table() -> str:
    """The README's environment-variable table (a unit test keeps the two
    in step)."""
    rows = ["| variable | effect |", "|---|---|"]
    rows += [f"| `{var.name}={var.example}` | {var.help} |" for var in ALL]
    return "\n".join(rows) + "\n"
