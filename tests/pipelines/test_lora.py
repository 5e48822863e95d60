"""LoRA per request (engine_lib/lora.py) in the engine's own runner, for every image pipeline.

The reference is diffusers itself: a second copy of the pipeline with
`load_lora_weights(file)` and `set_adapters([name], [scale])`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_lib.engine import DiffusionEngine
from engine_lib.interface import to_uint8
from engine_lib.lora import LoraLibrary
from engine_lib.request import InvalidInputError
from engine_lib.pipelines.tiny_models import ensure_loras, ensure_model
from tests.helpers.lora_checks import assert_within_one_level, diffusers_with_lora
from tests.helpers.parity_checks import TEST_CONFIG, Arrival, parse, run_steps, run_wave, solo_steps

PIPELINES = ("qwen_image", "flux", "sd3", "z_image", "flux2")
BASE = {"prompt": "a photo of a cat", "height": 32, "width": 32, "num_inference_steps": 3, "seed": 5}


@pytest.fixture(scope="module", params=PIPELINES)
def setup(request, tmp_path_factory):
    """(adapter with its own lora_dir holding toy_a, toy_b and toy_all, that folder, the model folder)."""
    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import load_adapter

    pipeline = request.param
    model_dir = ensure_model(pipeline, "tiny")
    lora_dir = tmp_path_factory.mktemp(f"loras-{pipeline}")
    for name in ("toy_a", "toy_b", "toy_all"):
        shutil.copy(ensure_loras(pipeline, model_dir) / f"{name}.safetensors", lora_dir)
    adapter = load_adapter(EngineConfig.of(pipeline=pipeline, model_path=str(model_dir), device="cpu", dtype="float32",
                                           lora_dir=str(lora_dir), max_loras=2))
    return adapter, lora_dir, model_dir


def lora_per_row(adapter) -> bool:
    """Whether rows with different LoRAs share a step forward (Z-Image's keys hold one LoRA per forward: its
    embedders see every row's tokens concatenated)."""
    return "lora" not in dict(adapter.key_fields(parse(adapter, {**BASE, "lora_name": "toy_a"})))


@pytest.mark.parametrize("name", ["toy_a", "toy_all"], ids=["attention", "every-layer"])
def test_a_served_lora_equals_diffusers_set_adapters_bitwise(setup, name):
    adapter, lora_dir, model_dir = setup
    inputs = {**BASE, "lora_name": name, "lora_scale": 0.5}
    ours = solo_steps(adapter, inputs)
    expected = to_uint8(diffusers_with_lora(adapter, model_dir, lora_dir, name, 0.5, inputs))
    assert np.array_equal(ours, expected)
    assert not np.array_equal(ours, solo_steps(adapter, BASE)), "the LoRA changes the image"


def test_different_loras_share_one_step_batch_and_match_their_solo_runs(setup):
    adapter, _, _ = setup
    cases = {"none": BASE, "a": {**BASE, "lora_name": "toy_a"}, "a_half": {**BASE, "lora_name": "toy_a", "lora_scale": 0.5},
             "b": {**BASE, "lora_name": "toy_b", "seed": 6}}
    if not lora_per_row(adapter):  # a LoRA (and scale) per forward: the scheduler never puts these together
        assert len({adapter.step_key(parse(adapter, inputs)) for inputs in cases.values()}) == len(cases)
        return
    mixed = run_steps(adapter, [Arrival(i // 2, rid, p) for i, (rid, p) in enumerate(cases.items())], capacity=4)
    assert max(mixed.forward_sizes) == 4, "all four shared a forward"
    for rid, inputs in cases.items():
        assert_within_one_level(mixed.images[rid], solo_steps(adapter, inputs), rid)


@pytest.mark.parametrize("first, second", [("toy_a", "toy_b"), ("toy_all", "toy_a")], ids=["attention", "every-layer"])
def test_loras_on_rows_of_different_sizes_share_a_forward(setup, first, second):
    """With mixed_size_batching (the rows' image tokens packed into one sequence) each row still gets its
    own LoRA, and each image matches its solo run; also with a LoRA on every layer (toy_all), where some
    layers see the packed tokens, some the rows, and SD3's patch convolution one size's rows at a time."""
    from engine_lib.config import EngineConfig
    from engine_lib.pipelines.registry import load_adapter

    adapter, lora_dir, model_dir = setup
    if not adapter.step_key_skips:
        pytest.skip(f"{adapter.name} keeps one image size per forward")
    mixed = load_adapter(EngineConfig.of(pipeline=adapter.name, model_path=str(model_dir), device="cpu",
                                         dtype="float32", lora_dir=str(lora_dir), mixed_size_batching=True,
                                         step_execution=True))
    cases = {"first-32": {**BASE, "lora_name": first}, "none-64x48": {**BASE, "height": 64, "width": 48},
             "second-64": {**BASE, "lora_name": second, "height": 64, "width": 64, "seed": 6},
             "first_half-32x64": {**BASE, "lora_name": first, "lora_scale": 0.5, "height": 32, "width": 64}}
    together = run_steps(mixed, [Arrival(0, rid, p) for rid, p in cases.items()], capacity=4)
    assert max(together.forward_sizes) == 4, "all four sizes shared a forward"
    for rid, inputs in cases.items():
        assert_within_one_level(together.images[rid], solo_steps(adapter, inputs), rid)


def test_request_mode_keys_one_lora_per_wave(setup):
    adapter, _, _ = setup
    a, b = parse(adapter, {**BASE, "lora_name": "toy_a"}), parse(adapter, {**BASE, "lora_name": "toy_b"})
    assert adapter.request_key(a) != adapter.request_key(b)
    assert adapter.request_key(a) != adapter.request_key(parse(adapter, {**BASE, "lora_name": "toy_a", "lora_scale": 2}))
    if lora_per_row(adapter):
        assert adapter.step_key(a) == adapter.step_key(b) == adapter.step_key(parse(adapter, BASE))
    else:
        assert len({adapter.step_key(a), adapter.step_key(b), adapter.step_key(parse(adapter, BASE))}) == 3
    [wave_a, _] = run_wave(adapter, [{**BASE, "lora_name": "toy_a"}, {**BASE, "lora_name": "toy_a", "seed": 9}])
    assert_within_one_level(wave_a, solo_steps(adapter, {**BASE, "lora_name": "toy_a"}))


@pytest.mark.parametrize("name, says", [("nope", "available: toy_a, toy_all, toy_b"), ("../toy_a", "no path"),
                                        ("a/b", "no path"), ("..", "no path")])
def test_bad_names_are_refused_naming_lora_name(setup, name, says):
    adapter, _, _ = setup
    with pytest.raises(InvalidInputError) as info:
        parse(adapter, {**BASE, "lora_name": name})
    assert info.value.input_name == "lora_name" and says in str(info.value)


def test_a_file_dropped_in_is_usable_and_a_corrupt_one_fails_alone(setup):
    adapter, lora_dir, _ = setup
    shutil.copy(lora_dir / "toy_b.safetensors", lora_dir / "toy_c.safetensors")
    (lora_dir / "broken.safetensors").write_bytes(b"not a safetensors file")
    try:
        images = run_steps(adapter, [Arrival(0, "c", {**BASE, "lora_name": "toy_c"})]).images
        assert np.array_equal(images["c"], solo_steps(adapter, {**BASE, "lora_name": "toy_b"}))
        finals = DiffusionEngine.wave(adapter, TEST_CONFIG, 2).generate(
            {"good": parse(adapter, BASE), "bad": parse(adapter, {**BASE, "lora_name": "broken"})})
        assert finals["good"].ok and "image" in finals["good"].outputs and not finals["bad"].ok
        assert "lora_name" in str(finals["bad"].error) and "could not be loaded" in str(finals["bad"].error)
        assert len(adapter.loras.loaded) <= 2, "max_loras bounds what stays loaded"
    finally:
        (lora_dir / "toy_c.safetensors").unlink()
        (lora_dir / "broken.safetensors").unlink()


def write_text_encoder_lora(adapter, model_dir, lora_dir, name: str) -> None:
    """A LoRA on the text encoder's attention alone, as `save_lora_weights` writes one."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    encoder = type(adapter.pipe.text_encoder).from_pretrained(str(model_dir / "text_encoder"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False), encoder, adapter_name=name)
    layers = get_peft_model_state_dict(encoder, adapter_name=name)
    layers = {k: v * 8 if ".lora_B." in k else v for k, v in layers.items()}  # visible in a tiny model's image
    type(adapter.pipe).save_lora_weights(str(lora_dir), text_encoder_lora_layers=layers,
                                         weight_name=f"{name}.safetensors")


def test_a_lora_on_the_text_encoder_changes_its_own_requests_prompt_only(setup):
    """diffusers loads a LoRA's text-encoder layers too (Flux, SD3): they apply to the encoding of the requests
    that name the LoRA, at their scale, as set_adapters does; a prompt embedding cached without the LoRA is not
    theirs, and requests without it encode as if it had never been loaded."""
    adapter, lora_dir, model_dir = setup
    if "text_encoder" not in type(adapter.pipe)._lora_loadable_modules:
        pytest.skip(f"{adapter.name}'s LoRA loader takes transformer layers only")
    write_text_encoder_lora(adapter, model_dir, lora_dir, "toy_text")
    try:
        plain = solo_steps(adapter, BASE)  # its prompt embedding is cached now
        ours = solo_steps(adapter, {**BASE, "lora_name": "toy_text", "lora_scale": 0.5})
        expected = diffusers_with_lora(adapter, model_dir, lora_dir, "toy_text", 0.5, BASE)
        assert np.array_equal(ours, to_uint8(expected))
        assert not np.array_equal(ours, plain), "the LoRA changes the image through the prompt"
        dog = {**BASE, "prompt": "a photo of a dog"}  # encoded while toy_text is loaded; scale 0: diffusers without it
        assert np.array_equal(solo_steps(adapter, dog), to_uint8(diffusers_with_lora(
            adapter, model_dir, lora_dir, "toy_text", 0.0, dog)))
    finally:
        (lora_dir / "toy_text.safetensors").unlink()


class FakeLoraPipe:
    """What LoraLibrary asks of a pipeline, recording which files it loads and unloads (no model, no layers)."""

    def __init__(self):
        self.transformer = SimpleNamespace(peft_config={}, modules=lambda: [])
        self.loads, self.unloads = [], []

    def load_lora_weights(self, path, adapter_name):
        self.loads.append(Path(path).stem)
        self.transformer.peft_config[adapter_name] = Path(path).stem

    def delete_adapters(self, adapters):
        self.unloads += [self.transformer.peft_config.pop(a) for a in adapters]


def test_the_least_recently_used_lora_is_unloaded_first(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"")
    pipe = FakeLoraPipe()
    library = LoraLibrary(pipe, str(tmp_path), max_loras=2)
    for names in (["a"], ["b"], ["a"], ["c"]):  # "a" loaded first but used after "b"
        library.ensure(names)
    assert pipe.unloads == ["b"] and library.loaded == ["a", "c"]
    library.ensure(["c", "b"])  # "a" is now the least recently used; the batch needs the other two
    assert pipe.unloads == ["b", "a"] and library.loaded == ["c", "b"]


def test_a_changed_file_is_reloaded_and_an_unchanged_one_is_not(tmp_path):
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"1")
    pipe = FakeLoraPipe()
    library = LoraLibrary(pipe, str(tmp_path))
    library.ensure(["a"])
    library.ensure(["a"])
    assert pipe.loads == ["a"]
    path.write_bytes(b"2")
    later = path.stat().st_mtime_ns + 1_000_000_000  # whatever the file system's time resolution
    os.utime(path, ns=(later, later))
    library.ensure(["a"])
    library.ensure(["a"])
    assert pipe.loads == ["a", "a"] and pipe.unloads == ["a"] and library.loaded == ["a"]
