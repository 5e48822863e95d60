"""The model repository and the docs tables follow the adapters' declarations (`make repository`)."""

from __future__ import annotations

import shutil

from engine_lib.pipelines import registry
from engine_lib.serving import repository


def test_checked_in_files_match_the_declarations():
    assert repository.drifted() == [], "run `make repository` and commit the result"


def test_every_registered_pipeline_has_an_entry_and_no_entry_lacks_a_pipeline():
    entries = sorted(p.name for p in repository.MODEL_REPOSITORY.iterdir() if (p / "config.pbtxt").is_file())
    assert entries == registry.names()


def test_a_drifted_block_is_found_and_rewritten_and_the_rest_is_kept(tmp_path):
    repo, doc = tmp_path / "model_repository", tmp_path / "pipelines.md"
    shutil.copytree(repository.MODEL_REPOSITORY, repo)
    shutil.copy(repository.PIPELINES_DOC, doc)
    config = repo / "qwen_image" / "config.pbtxt"
    edited = config.read_text().replace('name: "seed", data_type: TYPE_INT64', 'name: "seed", data_type: TYPE_INT32')
    edited = edited.replace('string_value: "4" } }', 'string_value: "8" } }')  # a deployer's own parameter
    config.write_text(edited)
    assert repository.drifted(repo, doc) == [config]
    expected = repository.expected_files(repo, doc)[config]
    assert 'name: "seed", data_type: TYPE_INT64' in expected
    assert 'key: "max_num_seqs", value: { string_value: "8" }' in expected  # outside the block: kept


def test_a_new_pipeline_gets_a_whole_entry(tmp_path):
    cls = registry.get_adapter_class("sd3")
    text = repository.new_config(cls)
    assert text.startswith("# `StableDiffusion3Pipeline` (text-to-image)")
    assert repository.io_block(cls) in text
    assert 'key: "pipeline", value: { string_value: "sd3" }' in text
    assert 'key: "step_execution", value: { string_value: "true" }' in text
