"""Every environment variable the overlay reads, in one table."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)

    def flag(self) -> bool:
        value = self.raw().strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("", "0", "false", "no", "off"):
            return False
        raise ValueError(f"{self.name}={self.raw()!r}: expected 0/1, "
                         "true/false, yes/no or on/off")

    def items(self) -> list[str]:
        return [part.strip() for part in self.raw().split(",") if part.strip()]


DISABLE = EnvVar("VLLM_OVERLAY_DISABLE", "0",
                 "1: the plugin does nothing (stock vLLM).")
STRICT = EnvVar("VLLM_OVERLAY_STRICT", "0",
                "1: an unsupported vLLM version is an error, not a warning.")
SKIP_PATCHES = EnvVar("VLLM_OVERLAY_SKIP_PATCHES", "",
                      "Comma-separated patch ids to leave unapplied.")

ALL = (DISABLE, STRICT, SKIP_PATCHES)
