"""The README and docs/ say what the code does: the first screen's table
agrees with the version gate, its lines that turn each feature on are
configurations the overlay accepts, every link resolves, and the README
stays short."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from vllm_overlay import version_gate
from vllm_overlay.integration import pp_kv
from vllm_overlay.integration.v0_32 import config_check
from vllm_overlay.testing import v0_32 as testing_v0_32

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "PATCHES.md", *sorted((ROOT / "docs").glob("*.md"))]
CELLS = {
    "overlay (tested here)",
    "overlay (not runnable here)",
    "upstream already",
    "overlay (checked against 0.33's code ²)",
}
TARGETS = ["0.11.2 CPU", "0.11.2 GPU", "0.32 CPU", "0.32 GPU", "0.33 GPU ¹"]
FEATURES = [
    "cross-layer KV blocks",
    "fast block transfers / host offloading",
    "pipeline-parallel KV budget",
    "shared KV pool on Redis/Valkey",
]
SERVE_CONFIG = re.compile(r"--kv-transfer-config '(\{.*?\})'")


def first_table() -> dict[str, dict[str, str]]:
    """The README's first table: feature -> target -> cell."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| feature |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    assert header == ["feature", *TARGETS]
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        feature, *cells = [c.strip() for c in line.strip("|").split("|")]
        table[feature] = dict(zip(TARGETS, cells))
    return table


def turn_on_block() -> list[str]:
    """The first screen's code block of `vllm serve` lines (one per feature)."""
    text = README.read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return block.splitlines()


def test_readme_is_short_and_its_first_screen_comes_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"
    first = "\n".join(lines[:50])
    for needed in ("| feature |", "vllm serve", "see-it-work.md", "scripts/test.sh"):
        assert needed in first, f"{needed!r} is not on the README's first screen"


def test_the_table_has_one_known_value_per_cell():
    table = first_table()
    assert list(table) == FEATURES
    for feature, row in table.items():
        for target, cell in row.items():
            assert cell in CELLS, (feature, target, cell)


def test_the_table_agrees_with_the_version_gate():
    """0.32 and 0.11.2 are supported, with the PP budget on both and the
    pool tier on 0.32; on 0.33 (GPU only) the overlay has the pool tier and
    the PP budget, checked against its code, and refuses the CPU-platform
    features (version_gate.FEATURE_RELEASES, NO_CPU_BUILD)."""
    table = first_table()
    assert version_gate.is_supported_version("0.32.0")
    assert version_gate.is_supported_version("0.11.2")
    assert version_gate.feature_runs_on("pp_prop_kv_cache", "0.32.0")
    assert version_gate.feature_runs_on("pool_tier", "0.32.0")
    for feature in ("pipeline-parallel KV budget", "shared KV pool on Redis/Valkey"):
        assert table[feature]["0.32 CPU"] == "overlay (tested here)"
        assert table[feature]["0.33 GPU ¹"] == "overlay (checked against 0.33's code ²)"
    assert version_gate.feature_runs_on("pp_prop_kv_cache", "0.33.0")
    assert version_gate.feature_runs_on("pool_tier", "0.33.0")
    assert not version_gate.feature_runs_on("cpu_platform", "0.33.0")
    assert "0.33.x" in version_gate.NO_CPU_BUILD
    for feature in ("cross-layer KV blocks", "fast block transfers / host offloading"):
        assert table[feature]["0.33 GPU ¹"] == "upstream already"


def test_the_lines_that_turn_features_on_are_accepted_configurations():
    lines = [line for line in turn_on_block() if "vllm serve" in line]
    assert len(lines) == len(FEATURES), lines
    layout, offload, pp, pool = lines
    assert layout.startswith(f"VLLM_KV_CACHE_LAYOUT={testing_v0_32.CROSS_LAYER} ")
    assert pp_kv.CLI_FLAG in pp and "--kv-cache-memory-bytes" in pp
    for line in (offload, pool):
        config = json.loads(SERVE_CONFIG.search(line).group(1))
        assert config["kv_connector"] == "OffloadingConnector"
        assert config_check.offloading_refusal(_kv(config), memory=2**40) is None
    (tier,) = json.loads(SERVE_CONFIG.search(pool).group(1))[
        "kv_connector_extra_config"
    ]["secondary_tiers"]
    assert tier["module_path"] == config_check.POOL_TIER_MODULE
    assert tier["type"] == config_check.POOL_TIER_CLASS


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_kv_transfer_config_example_is_json(page):
    for match in SERVE_CONFIG.finditer(page.read_text()):
        config = json.loads(match.group(1))
        if config["kv_connector"] == "OffloadingConnector":
            assert config_check.offloading_refusal(_kv(config), memory=2**40) is None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    """Files exist; an anchor into a Markdown page names one of its headings."""
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text())
    for target, anchor in links:
        if "://" in target:
            continue
        path = page.parent / target if target else page
        assert path.exists(), f"{page.name}: {target}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page.name}: {target}#{anchor}"


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of PAGE's headings (lower case, punctuation dropped,
    spaces to hyphens)."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def _kv(config: dict):
    class KV:
        kv_connector = config["kv_connector"]
        kv_connector_extra_config = config.get("kv_connector_extra_config") or {}

    return KV
