"""docs/configuration.md is the settings reference: every field of `eagle3q.config.Settings` has its row, with its
real default, and no row names a setting that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import SecretStr

from eagle3q.config import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `EAGLE3Q_([A-Z0-9_]+)` \|([^|]*)\|", re.M)
# Defaults that are computed, documented as the rule that computes them.
DERIVED = {"aux_layer_ids": "[2, L//2, L-3]"}
NOT_A_FIELD = {"config"}  # EAGLE3Q_CONFIG names the TOML file the fields are read from


def _documented() -> dict[str, str]:
    return {name.lower(): default.strip().strip("`") for name, default in ROW.findall(DOC.read_text())}


def _same(doc: str, default: object) -> bool:
    if isinstance(default, bool):
        return doc == str(default).lower()
    if default is None or default == "" or isinstance(default, SecretStr):
        return doc == ""
    if isinstance(default, int | float):
        return float(doc) == float(default)
    if isinstance(default, list):
        return doc == ",".join(map(str, default)) or doc == str(default)
    return doc == str(default)


def test_every_setting_is_documented_with_its_default() -> None:
    doc = _documented()
    fields = Settings.model_fields
    assert set(fields) - set(doc) == set(), "settings missing from docs/configuration.md"
    assert set(doc) - set(fields) - NOT_A_FIELD == set(), "docs/configuration.md names settings that do not exist"
    wrong = {name: (doc[name], f.default) for name, f in fields.items()
             if not (doc[name] == DERIVED[name] if name in DERIVED else _same(doc[name], f.default))}
    assert not wrong, wrong


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    root = DOC.parents[1]
    broken = []
    for page in [root / "README.md", root / "ARCHITECTURE.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, broken
