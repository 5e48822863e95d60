"""docs/configuration.md lists exactly EngineConfig's parameters, each with its real default."""

from __future__ import annotations

import dataclasses
import re

from engine_lib.config import EngineConfig
from engine_lib.serving.launcher import REPO_ROOT

ROW = re.compile(r"^\|\s*`([a-z_]+)`\s*\|\s*`([^`]*)`\s*\|")


def documented_defaults() -> dict[str, str]:
    text = (REPO_ROOT / "docs" / "configuration.md").read_text()
    rows = [ROW.match(line) for line in text.splitlines()]
    return {m.group(1): m.group(2) for m in rows if m}


def test_table_lists_exactly_the_engine_config_fields():
    documented = documented_defaults()
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    assert sorted(documented) == sorted(fields)


def test_documented_defaults_parse_to_the_real_defaults():
    documented = documented_defaults()
    defaults = EngineConfig()
    for name, text in documented.items():
        value = "" if text == '""' else text
        parsed = getattr(EngineConfig.from_parameters({name: value}), name)
        assert parsed == getattr(defaults, name), f"{name}: documented {text!r}, default {getattr(defaults, name)!r}"
