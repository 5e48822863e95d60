"""LoRA per request through a real tritonserver: qwen_image in step mode with its own lora_dir, under
`offload=model` (both of its devices the CPU here: a GPU's code path, each LoRA load taking the offload hooks off
and putting them back), every image still bitwise or within a level of diffusers' own.

Requests that must share a forward are held by the engine's tick budget until all wait.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch

from engine_lib.interface import to_uint8
from engine_lib.pipelines.tiny_models import ensure_loras
from tests.helpers.parity_checks import assert_within_one_level
from tests.helpers.servers import default_model_path, module_server_of, start_server
from tests.helpers.streaming import RequestStream, close_all, run_held, run_request

BASE = {"prompt": "a photo of a cat", "height": 32, "width": 32, "num_inference_steps": 3, "seed": 5}


def start_lora_server(tmp_path_factory):
    path = default_model_path()
    lora_dir = tmp_path_factory.mktemp("loras")
    for name in ("toy_a", "toy_b"):
        shutil.copy(ensure_loras("qwen_image", path) / f"{name}.safetensors", lora_dir)
    server = start_server(tmp_path_factory.mktemp("lora-server"), path, step_execution="true", max_num_seqs="4",
                          lora_dir=str(lora_dir), max_loras="2", offload="model", wait=False)
    server.lora_dir, server.model_dir = lora_dir, path
    return server


lora_server = module_server_of(start_lora_server)


def image(server, **inputs) -> np.ndarray:
    result = run_request(server.grpc_url, **{**BASE, **inputs})
    assert not result.errors, result.errors
    return result.final.as_numpy("image")


def error(server, **inputs) -> str:
    result = run_request(server.grpc_url, **{**BASE, **inputs})
    assert result.num_final == 1 and result.errors
    return str(result.errors[0])


def test_a_lora_changes_the_image_as_diffusers_set_adapters_does(lora_server):
    import diffusers

    served = image(lora_server, lora_name="toy_a", lora_scale=0.5)
    assert not np.array_equal(served, image(lora_server))
    pipe = diffusers.QwenImagePipeline.from_pretrained(lora_server.model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_server.lora_dir / "toy_a.safetensors"), adapter_name="toy_a")
    pipe.set_adapters(["toy_a"], [0.5])
    expected = pipe(prompt=BASE["prompt"], height=32, width=32, num_inference_steps=3, output_type="np",
                    generator=torch.Generator().manual_seed(BASE["seed"])).images
    assert np.array_equal(served, to_uint8(expected))  # bitwise (CPU float32)
    assert re.search(r"levers offload=model; weight bytes: ", lora_server.log_text())


def test_different_loras_in_one_step_batch_equal_their_solo_runs(lora_server):
    cases = [{}, {"lora_name": "toy_a"}, {"lora_name": "toy_b", "lora_scale": 0.7, "seed": 6}]
    solo = [image(lora_server, **case) for case in cases]
    lora_server.budget.hold()
    streams = [RequestStream(lora_server.grpc_url).send(f"m{i}", **{**BASE, **case}) for i, case in enumerate(cases)]
    try:
        run_held(lora_server, waiting=3, ticks=1)  # the first tick admits all three into one forward
        lora_server.budget.release()
        results = [s.collect() for s in streams]
    finally:
        close_all(streams, lora_server.budget)
    for result, expected in zip(results, solo):
        assert not result.errors, result.errors
        assert_within_one_level(result.final.as_numpy("image"), expected)


def test_a_file_dropped_into_lora_dir_works_without_a_restart(lora_server):
    shutil.copy(lora_server.lora_dir / "toy_b.safetensors", lora_server.lora_dir / "fresh.safetensors")
    try:
        assert np.array_equal(image(lora_server, lora_name="fresh"), image(lora_server, lora_name="toy_b"))
    finally:
        (lora_server.lora_dir / "fresh.safetensors").unlink()


@pytest.mark.parametrize("name, says", [("nope", "available: toy_a, toy_b"), ("../toy_a", "no path"),
                                        ("sub/toy_a", "no path")])
def test_bad_names_get_invalid_arg_naming_lora_name(lora_server, name, says):
    message = error(lora_server, lora_name=name)
    assert "INVALID_ARG" in message and "input 'lora_name'" in message and says in message, message
    assert str(lora_server.lora_dir) not in message  # names files, not where they lie


def test_a_corrupt_file_fails_its_request_alone(lora_server):
    (lora_server.lora_dir / "broken.safetensors").write_bytes(b"\0" * 64)
    try:
        message = error(lora_server, lora_name="broken")
        assert "input 'lora_name'" in message and "could not be loaded" in message, message
        assert str(lora_server.lora_dir) not in message
        assert image(lora_server, lora_name="toy_a").shape == (1, 32, 32, 3)  # the server serves on
    finally:
        (lora_server.lora_dir / "broken.safetensors").unlink()
