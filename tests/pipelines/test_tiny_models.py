"""The offline tiny pipelines: deterministic, loadable with from_pretrained, runnable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine_lib.pipelines import tiny_models
from tests.helpers.early_servers import starts_early, take_early

TINY_PIPELINES = sorted(name for name, presets in tiny_models.available().items() if "tiny" in presets)
CALL_KWARGS = {"flux": {"max_sequence_length": 32},
               "ltx2": {"num_frames": 33}, "helios": {"num_frames": 33},  # 33 frames: one Helios chunk
               # Kontext: its image at its size, and max_area that keeps 64x64 (its default is a megapixel)
               "flux_kontext": {"image": Image.new("RGB", (32, 32), (128, 128, 128)), "_auto_resize": False,
                                "max_area": 64 * 64, "max_sequence_length": 32},
               "qwen_image_edit": {"image": Image.new("RGB", (32, 32), (128, 128, 128))},
               "qwen_image_edit_plus": {"image": [Image.new("RGB", (32, 32), (128, 128, 128))]},
               "wan": {"num_frames": 33}, "wan_i2v": {"image": Image.new("RGB", (64, 64), (128, 128, 128)),
                                                      "num_frames": 33}}


def pipeline_class(name: str) -> str:
    """The diffusers class the adapter loads (adapters of our own model code have none to check)."""
    from engine_lib.pipelines.registry import get_adapter_class

    return getattr(get_adapter_class(name), "pipeline_class", "")


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class OtherProcessBuild:
    """Every tiny pipeline built into `root` by a fresh process: tokenizer trainers use per-process hash seeds."""

    def __init__(self, root: Path):
        self.root = root
        code = (
            "import sys\nfrom engine_lib.pipelines.tiny_models import ensure_model\n"
            "for name in sys.argv[2:]:\n    ensure_model(name, out_dir=sys.argv[1] + '/' + name)\n"
        )
        repo_root = Path(tiny_models.__file__).resolve().parents[2]
        self.process = subprocess.Popen([sys.executable, "-c", code, str(root), *TINY_PIPELINES], cwd=repo_root)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def start_other_process_build(tmp_path_factory) -> OtherProcessBuild:
    return OtherProcessBuild(tmp_path_factory.mktemp("other_process"))


@pytest.fixture(scope="module")
@starts_early(start_other_process_build)
def other_process_builds(tmp_path_factory) -> Path:
    """The other process's builds, started right after collection (tests/helpers/early_servers.py): they run on the
    core the tests before this module leave idle."""
    build = take_early(start_other_process_build, tmp_path_factory)
    assert build.process.wait() == 0, "the other process's build failed"
    return build.root


@pytest.fixture(scope="module")
def saved_dirs(tiny_qwen_dir) -> dict:
    """Each tiny pipeline saved under models/ (the shared fixture for Qwen-Image)."""
    return {name: tiny_qwen_dir if name == "qwen_image" else tiny_models.ensure_model(name) for name in TINY_PIPELINES}


def test_registry_lists_all_pipelines():
    assert {"qwen_image", "flux", "sd3"} <= set(TINY_PIPELINES)
    assert "bench" in tiny_models.available()["qwen_image"]


@pytest.mark.parametrize("name", TINY_PIPELINES)
def test_builds_are_byte_identical(name, tmp_path, other_process_builds, saved_dirs):
    here = _files(tiny_models.ensure_model(name, out_dir=tmp_path / name))
    assert any(path.endswith(".safetensors") for path in here)
    assert any(path.endswith("tokenizer.json") for path in here)
    for other in (other_process_builds / name, saved_dirs[name]):
        there = _files(other)
        assert here.keys() == there.keys()
        assert [path for path in here if here[path] != there[path]] == []


def test_seed_changes_the_weights():
    a = tiny_models.build_pipeline("qwen_image", seed=0).transformer.state_dict()
    b = tiny_models.build_pipeline("qwen_image", seed=1).transformer.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_models.build_pipeline("qwen_image")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", TINY_PIPELINES)
def test_saved_dir_loads_and_generates(name, saved_dirs):
    from engine_lib.pipelines.registry import get_adapter_class

    from diffusers import DiffusionPipeline

    if pipeline_class(name):
        extra = get_adapter_class(name).from_pretrained_kwargs(str(saved_dirs[name]))  # (the edit processor)
        pipe = DiffusionPipeline.from_pretrained(str(saved_dirs[name]), **extra)
        assert type(pipe).__name__ == pipeline_class(name)
        denoiser = pipe.transformer
    else:  # our own model code loads through its adapter
        pipe = get_adapter_class(name).load(str(saved_dirs[name]), torch.device("cpu"), torch.float32).pipe
        denoiser = pipe.model
    pipe.set_progress_bar_config(disable=True)
    assert all(p.dtype == torch.float32 for p in denoiser.parameters())
    primary = get_adapter_class(name).outputs[0]  # image, or video (33 frames: one Helios chunk)
    images = getattr(pipe(
        prompt="a photo of a cat",
        height=64,
        width=64,
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **CALL_KWARGS.get(name, {}),
    ), primary.pipe_output)
    assert images.shape == ((1, 64, 64, 3) if primary.name == "image" else (1, 33, 64, 64, 3))
    assert np.isfinite(images).all()
    assert images.std() > 0


def test_qwen_template_prefix_is_34_tokens(tiny_qwen_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen_dir / "tokenizer"))
    template = "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    prefix = template.split("{}")[0]
    assert len(tokenizer(prefix).input_ids) == 34
    # The user text starts right after the dropped prefix.
    ids = tokenizer(template.format("a cat")).input_ids
    assert tokenizer.decode(ids[34:]).startswith("a cat<|im_end|>")


def test_qwen_transformer_takes_row_timesteps_and_padded_mask():
    pipe = tiny_models.build_pipeline("qwen_image")
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(["a cat", "an astronaut riding a horse on the moon"], device="cpu")
        short, short_mask = pipe.encode_prompt("a cat", device="cpu")
        assert mask is not None and not mask[0].all() and short_mask is None
        latents = torch.randn(2, 64, 4 * pipe.vae.config.z_dim, generator=torch.Generator().manual_seed(0))

        def run(rows, emb, m, t):
            return pipe.transformer(
                hidden_states=latents[rows],
                encoder_hidden_states=emb,
                encoder_hidden_states_mask=m,
                timestep=torch.tensor(t),
                img_shapes=[[(1, 8, 8)]] * len(t),
                return_dict=False,
            )[0]

        batched = run(slice(0, 2), embeds, mask, [0.9, 0.3])
        solo = run(slice(0, 1), short, None, [0.9])
    # Padding is masked out: the padded row matches the unpadded solo run (not bitwise).
    torch.testing.assert_close(batched[:1], solo, rtol=1e-5, atol=1e-5)


def test_qwen_scheduler_config_and_one_step_nan():
    """Documents why adapters reject num_inference_steps < 2 with this scheduler config."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    scheduler = tiny_models.build_pipeline("qwen_image").scheduler
    from engine_lib.pipelines.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG

    for key, value in QWEN_IMAGE_SCHEDULER_CONFIG.items():
        assert scheduler.config[key] == value
    mu = calculate_shift(64, 256, 8192, 0.5, 0.9)
    with np.errstate(invalid="ignore", divide="ignore"):
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0, 1), mu=mu)
    assert torch.isnan(scheduler.sigmas[0])
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.5, 2), mu=mu)
    assert torch.isfinite(scheduler.sigmas).all()


def test_ensure_model_reuses_complete_and_rebuilds_incomplete(tmp_path, capsys):
    target = tmp_path / "qwen"
    assert tiny_models.main(["--pipeline", "qwen_image", "--out", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    weights = target / "transformer" / "diffusion_pytorch_model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert tiny_models.ensure_model(out_dir=target) == target
    assert weights.stat().st_mtime_ns == stamp

    (target / tiny_models.MARKER_FILE).unlink()  # as if a build had stopped half-way
    assert not tiny_models.is_complete(target, "qwen_image", "tiny")
    tiny_models.ensure_model(out_dir=target)
    assert tiny_models.is_complete(target, "qwen_image", "tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["qwen"]  # no temp dirs left behind


def test_default_dir_and_unknown_names():
    repo_root = Path(tiny_models.__file__).resolve().parents[2]
    assert tiny_models.default_model_dir("flux", "tiny") == repo_root / "models" / "flux-tiny"
    with pytest.raises(ValueError, match="pipeline"):
        tiny_models.build_pipeline("nope")
    with pytest.raises(ValueError, match="preset"):
        tiny_models.ensure_model("qwen_image", "huge")
