"""docs/pipelines.md's capability table is what the adapters' class flags say, row for row."""

from __future__ import annotations

import re

import pytest

from engine_lib.pipelines.base import COMMON_INPUTS, OPTIONAL_INPUT_DEFAULTS
from engine_lib.pipelines.registry import ADAPTERS, get_adapter_class
from engine_lib.tiny_models import REPO_ROOT

DOC = REPO_ROOT / "docs" / "pipelines.md"
HEADER = ["pipeline", "request batch", "step execution", "previews", "CFG", "negative prompt", "per-row guidance",
          "inputs beyond the common ones"]
CFG_TEXT = {"": "no", "cfg": "CFG (`guidance_scale` > 1)", "true_cfg": "true CFG (`true_cfg_scale` > 1)"}


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def expected_row(name: str) -> list[str]:
    cls = get_adapter_class(name)
    extra = sorted(cls.supported_inputs - COMMON_INPUTS)
    return [f"`{name}`", yes_no(cls.supports_request_batch), yes_no(cls.supports_step_execution),
            yes_no(cls.supports_previews), CFG_TEXT[cls.cfg_kind], yes_no("negative_prompt" in cls.supported_inputs),
            yes_no(cls.per_row_guidance), ", ".join(f"`{i}`" for i in extra)]


def doc_table() -> tuple[list[str], dict[str, list[str]]]:
    """The header and the rows (by pipeline cell) of the table whose first header cell is `pipeline`."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*pipeline\s*\|", line))
    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]
    header, rows = cells(lines[start]), {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = cells(line)
        rows[row[0]] = row
    return header, rows


def test_the_table_lists_every_registered_pipeline_with_its_flags():
    header, rows = doc_table()
    assert header == HEADER
    assert sorted(rows) == sorted(f"`{name}`" for name in ADAPTERS)
    for name in ADAPTERS:
        assert rows[f"`{name}`"] == expected_row(name), f"docs/pipelines.md row for {name}"


def test_the_doc_names_the_common_inputs():
    common = ", ".join(f"`{i}`" for i in sorted(COMMON_INPUTS))
    assert common in DOC.read_text()


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_flags_agree_with_each_other(name):
    """A feature flag and the inputs that drive it are declared together."""
    cls = get_adapter_class(name)
    assert cls.supported_inputs <= set(OPTIONAL_INPUT_DEFAULTS), "supported_inputs names SamplingParams fields"
    assert COMMON_INPUTS <= cls.supported_inputs
    assert cls.supports_previews == ("preview_interval" in cls.supported_inputs)
    assert cls.cfg_kind in CFG_TEXT
    if cls.cfg_kind == "true_cfg":
        assert {"negative_prompt", "true_cfg_scale"} <= cls.supported_inputs
    if cls.cfg_kind == "cfg":
        assert "guidance_scale" in cls.supported_inputs and "true_cfg_scale" not in cls.supported_inputs
    if cls.per_row_guidance:
        assert "guidance_scale" in cls.supported_inputs
