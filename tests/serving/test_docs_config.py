"""docs/configuration.md lists exactly EngineConfig's parameters, each with its real default."""

from __future__ import annotations

import re

from engine_lib.config import INPUT_DEFAULTS, INPUT_MAX, PARAMETERS, EngineConfig
from engine_lib.serving.processes import REPO_ROOT

ROW = re.compile(r"^\|\s*`([a-z_]+)`\s*\|\s*`([^`]*)`\s*\|")


def documented_defaults() -> dict[str, str]:
    text = (REPO_ROOT / "docs" / "configuration.md").read_text()
    rows = [ROW.match(line) for line in text.splitlines()]
    return {m.group(1): m.group(2) for m in rows if m}


PER_INPUT = {"input_max": ("max_", INPUT_MAX), "input_defaults": ("default_", INPUT_DEFAULTS)}


def test_tables_list_exactly_the_engine_config_parameters():
    """Every field, and for the per-input ones (`max_<input>`, `default_<input>`) every built-in entry."""
    documented = documented_defaults()
    names = list(PARAMETERS)
    names += [prefix + name for prefix, entries in PER_INPUT.values() for name in entries]
    assert sorted(documented) == sorted(names)


def test_documented_defaults_parse_to_the_real_defaults():
    defaults = EngineConfig()
    for name, text in documented_defaults().items():
        value = "" if text == '""' else text
        parsed = EngineConfig.from_parameters({name: value})
        for field, (prefix, _) in PER_INPUT.items():
            if name.startswith(prefix) and name not in PARAMETERS:
                key = name.removeprefix(prefix)
                assert parsed.parameter(field)[key] == defaults.parameter(field)[key], name
                break
        else:
            assert parsed.parameter(name) == defaults.parameter(name), \
                f"{name}: documented {text!r}, default {defaults.parameter(name)!r}"
