"""What differs between two release records (``release_compat.py
--check``): one line per difference, so a stale record says what moved."""

from __future__ import annotations


def _files(record: dict) -> dict[str, set[str]]:
    """Each list of files in RECORD: ``touched`` and each feature's."""
    lists = {"touched": set(record.get("touched", {}))}
    for feature, files in record.get("features", {}).items():
        lists[f"feature {feature}"] = set(files)
    return lists


def differences(committed: dict, rebuilt: dict) -> list[str]:
    """COMMITTED against REBUILT, one line per difference (empty: equal)."""
    out = []
    old, new = _files(committed), _files(rebuilt)
    why = rebuilt.get("why", {})
    named: set[str] = set()  # a file a feature's line names is not repeated
    for name in sorted(set(old) | set(new), key=lambda n: n == "touched"):
        before, after = old.get(name, set()), new.get(name, set())
        if name == "touched":
            before, after = before - named, after - named
        named |= before ^ after
        for rel in sorted(after - before):
            out.append(f"{name}: + {rel} ({why.get(rel, 'no reason recorded')})")
        for rel in sorted(before - after):
            out.append(f"{name}: - {rel}")
    digests = committed.get("touched", {})
    for rel, digest in rebuilt.get("touched", {}).items():
        if rel in digests and digests[rel] != digest:
            out.append(f"touched: {rel}: sha256 {digests[rel][:12]} -> {digest[:12]}")
    for key in ("why", "releases", "builds"):
        before, after = committed.get(key, {}), rebuilt.get(key, {})
        names = set(before) | set(after)
        if key == "why":  # an added or removed file is named above
            names = set(before) & set(after)
        for name in sorted(names):
            if key == "releases" and name in before and name in after:
                out += _release(name, before[name], after[name])
            elif before.get(name) != after.get(name):
                out.append(
                    f"{key}: {name}: {_short(before.get(name))} -> "
                    f"{_short(after.get(name))}"
                )
    for key in sorted(set(committed) | set(rebuilt)):
        listed = key in {"touched", "features", "why", "releases", "builds"}
        if not listed and committed.get(key) != rebuilt.get(key):
            out.append(f"{key}: {committed.get(key)!r} -> {rebuilt.get(key)!r}")
    if not out and list(committed) != list(rebuilt):
        out.append(f"keys in another order: {list(committed)} -> {list(rebuilt)}")
    return out


def _release(version: str, before: dict, after: dict) -> list[str]:
    """What changed in one release's entry: its differing files, its flag,
    its test run."""
    out = []
    old, new = set(before.get("differs", [])), set(after.get("differs", []))
    if new - old:
        out.append(f"releases: {version}: differs + {', '.join(sorted(new - old))}")
    if old - new:
        out.append(f"releases: {version}: differs - {', '.join(sorted(old - new))}")
    for field in sorted((set(before) | set(after)) - {"differs"}):
        if before.get(field) != after.get(field):
            out.append(
                f"releases: {version}: {field}: {_short(before.get(field))} -> "
                f"{_short(after.get(field))}"
            )
    return out


def _short(value, limit: int = 160) -> str:
    text = "absent" if value is None else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
