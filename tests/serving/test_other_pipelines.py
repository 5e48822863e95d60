"""Every registered pipeline besides qwen_image (which the session's server covers) behind a real
tritonserver, from its generated repository entry: it loads, a served image is the diffusers image,
HTTP generate_stream streams PNGs; and for Flux and SD3 gRPC streaming with previews and their own
input rules. Flux, SD3 and FLUX.1 Kontext run with `mixed_size_batching=true`; they, BAGEL and HunyuanImage-3.0
have a tick budget each (held by the tests that check which requests share a forward).

One server for the module, holding every such model on its tiny pipeline (`model_path`
set per model: $DIFFUSION_MODEL_PATH is shared by every model of a server).
"""

from __future__ import annotations

import base64
import io
import shutil
import struct
import zlib

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from PIL import Image

from engine_lib.hooks import hooks_environment
from engine_lib.pipelines import registry
from engine_lib.pipelines.tiny_models import ensure_loras, ensure_model
from engine_lib.serving.processes import REPO_ROOT, free_port
from tests.helpers.early_servers import serve_early, starts_early
from tests.helpers.parity_checks import assert_within_one_level
from tests.helpers.servers import ProbedServer, set_parameter
from tests.helpers.streaming import (RequestStream, close_all, metric, post_json, run_concurrently, run_request, scrape,
                                     sse_events, wait_for_metric)
from tests.helpers.waiting import TickBudget

MODELS = tuple(name for name in registry.names() if name != "qwen_image")
# served with mixed_size_batching: image tokens packed (*/mixed_sizes.py; Kontext's with each row's condition tokens)
MIXED_SIZES = ("flux", "sd3", "flux_kontext")
HELD = MIXED_SIZES + ("bagel", "hunyuan_image3")  # with a tick budget (`server.budgets`, `run_together`)
SIZE_32 = ("qwen_image_edit", "qwen_image_edit_plus")  # sizes are multiples of 32 (their tiny VAE downsamples 16x)
# Served with cfg_batching=false, diffusers' own CFG execution (two forwards), so that a CFG request is bitwise
TWO_CFG_FORWARDS = ("flux2",)
# Inputs the parity request adds: CFG on, at scales that are not exactly FP32 (Z-Image's served default is Turbo's 0)
PARITY_EXTRA = {"z_image": dict(guidance_scale=0.6, negative_prompt="blurry"), "flux2": dict(guidance_scale=2.7)}
SLOW_PROMPT = "a slow river"  # an ltx2 request with it sleeps 1 s at each block boundary of its ticks (SlowPrompt)


@pytest.fixture(scope="module")
def model_dirs():
    return tiny_model_dirs()


def tiny_model_dirs() -> dict:
    return {name: ensure_model(name, "tiny") for name in MODELS}


def start_models_server(tmp_path_factory) -> ProbedServer:
    """The module's server, not waiting until it is ready."""
    model_dirs = tiny_model_dirs()
    tmp = tmp_path_factory.mktemp("other_pipelines")
    repo = tmp / "repository"
    budgets = {name: TickBudget(tmp / f"{name}_tick_budget") for name in HELD}
    for name in MODELS:
        shutil.copytree(REPO_ROOT / "model_repository" / name, repo / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
        config = repo / name / "config.pbtxt"
        text = set_parameter(config.read_text(), "model_path", str(model_dirs[name]))
        if name in MIXED_SIZES:
            text = set_parameter(text, "mixed_size_batching", "true")
        if name == "flux":
            text = set_parameter(text, "lora_dir", str(ensure_loras(name, model_dirs[name])))
        if name in TWO_CFG_FORWARDS:
            text = set_parameter(text, "cfg_batching", "false")
        config.write_text(text)
    srv = ProbedServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       address="127.0.0.1", log_path=tmp / "tritonserver.log", exit_timeout_s=30,
                       env={"OMP_NUM_THREADS": "1",  # two model processes share the CPU cores
                            **hooks_environment(ltx2={"slow_prompt": SLOW_PROMPT, "slow_block_s": 1.0},
                                                **{name: {"tick_budget_path": str(b.path)} for name, b in budgets.items()})})
    srv.budgets = budgets
    return srv.start(timeout_s=300, wait=False)


@pytest.fixture(scope="module")
@starts_early(start_models_server)
def server(tmp_path_factory):
    """The shipped configurations (flux, sd3: step execution, max_num_seqs 4), on the tiny models; Flux, SD3
    and FLUX.1 Kontext with mixed_size_batching on; the HELD models with a tick budget each (`server.budgets`).
    Started early (tests/helpers/early_servers.py): its ten stubs load while the tests before this module run."""
    yield from serve_early(start_models_server, tmp_path_factory)


def run_together(server, model: str, cases: dict[str, dict]) -> tuple[dict, float]:
    """Send every case, hold the engine until all of them wait, then let it run: {request id: result}, and the
    rows (requests summed over ticks) their run took. They all start in its first tick, so it takes as many
    ticks as the longest case has steps; none of its batched forwards failed and ran again one request at a
    time (the batch-size metric would still count them as shared)."""
    before = scrape(server.metrics_url)
    budget = server.budgets[model].hold()
    streams = []
    try:
        streams = [RequestStream(server.grpc_url).send(rid, model=model, **case) for rid, case in cases.items()]
        assert wait_for_metric(server.metrics_url, "diffusion_requests_waiting", len(cases), model=model) == len(cases)
        budget.release()
        results = {stream.request_id: stream.collect(timeout=120) for stream in streams}
    finally:
        close_all(streams, budget)
    ticks = metric(before, "diffusion_batch_size_count", model=model) + max(c["num_inference_steps"] for c in cases.values())
    assert wait_for_metric(server.metrics_url, "diffusion_batch_size_count", ticks, model=model) == ticks
    after = scrape(server.metrics_url)
    assert metric(after, "diffusion_batch_retries_total", model=model) == \
        metric(before, "diffusion_batch_retries_total", model=model), "a batch failed and ran one by one"
    for rid, result in results.items():
        assert not result.errors and result.num_final == 1, (rid, result.errors)
    return results, metric(after, "diffusion_batch_size_sum", model=model) - metric(before, "diffusion_batch_size_sum",
                                                                                     model=model)


def test_every_model_loads_its_pipeline(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert index == {name: "READY" for name in MODELS}
    log = server.log_text()
    for name in MODELS:
        assert f"{name}: loaded pipeline={name}" in log


@pytest.mark.parametrize("model, extra", [
    ("flux", dict(guidance_scale=2.0, negative_prompt="blurry", true_cfg_scale=3.0)),
    ("sd3", dict(guidance_scale=5.0, negative_prompt="blurry")),
])
def test_grpc_streams_previews_then_one_final_image(server, model, extra):
    """Three concurrent requests (different step counts, so they share step batches) with previews."""
    cases = [dict(prompt=f"a {color} square", height=48, width=64, num_inference_steps=steps, seed=i,
                  preview_interval=1, **extra)
             for i, (color, steps) in enumerate((("red", 3), ("green", 4), ("blue", 2)))]
    results = run_concurrently(server.grpc_url, cases, prefix=f"{model}-", model=model)
    for case, result in zip(cases, results):
        assert not result.errors, result.errors
        assert result.num_final == 1
        assert result.steps() == list(range(1, case["num_inference_steps"] + 1))
        for response in result.responses:  # every step a preview, then the final image
            image = response.as_numpy("image")
            assert image.dtype == np.uint8 and image.shape == (1, 48, 64, 3)
        assert bool(result.final.as_numpy("is_final")[0])
    finals = [r.final.as_numpy("image") for r in results]
    assert not np.array_equal(finals[0], finals[1])


@pytest.mark.parametrize("model", MODELS)
def test_served_outputs_are_the_pipelines_own(server, model_dirs, model):
    """A request alone on the server gives exactly `pipe(...)`'s outputs for the same seed and defaults,
    each declared output compared with the pipeline output it names (computed here on one CPU thread,
    as the server runs)."""
    from engine_lib.config import EngineConfig

    adapter = registry.load_adapter(EngineConfig.of(pipeline=model, model_path=str(model_dirs[model]), device="cpu",
                                                    dtype="float32"))
    inputs = dict(prompt="a lighthouse at dusk", height=64, width=64, num_inference_steps=3, seed=11,  # every model's size
                  **adapter.example_inputs(), **PARITY_EXTRA.get(model, {}))
    params = adapter.input_schema(EngineConfig()).parse(inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = adapter.pipe(**adapter.pipe_kwargs(params), output_type="np")
    finally:
        torch.set_num_threads(threads)
    result = run_request(server.grpc_url, model=model, request_id="parity", **inputs)
    assert not result.errors, result.errors
    for output in (o for o in adapter.outputs if o.pipe_output):
        np.testing.assert_array_equal(result.final.as_numpy(output.name),
                                      output.convert(getattr(expected, output.pipe_output)), err_msg=output.name)


@pytest.mark.parametrize("model", MIXED_SIZES)
def test_requests_of_different_sizes_share_every_forward_and_match_their_solo_images(server, model):
    """mixed_size_batching: four requests, held until all four wait, then run together, packed
    (*/mixed_sizes.py; token counts 64, 32, 32, 64: the packing reorders rows, and 32x64 and 64x32
    share a count but not their positions): each of their three ticks holds all four, and each image is
    within 1 level (in <= 0.1 % of values) of the same request served alone. FLUX.1 Kontext's rows each carry
    their own image's tokens (two image sizes: 32x32 and 48x32, kept at their size)."""
    sizes = ((64, 64), (32, 64), (64, 32), (64, 64))
    images = [dict(image=png_of(32 + 16 * (i % 2), 32), auto_resize=0) if model == "flux_kontext" else {}
              for i in range(len(sizes))]
    cases = {f"{model}-{i}-{h}x{w}": dict(prompt=prompt, height=h, width=w, num_inference_steps=3, seed=i, **image)
             for i, (prompt, (h, w), image) in enumerate(zip(("a red cube", "a green sphere", "a cat", "a boat"),
                                                             sizes, images))}
    together, rows = run_together(server, model, cases)
    assert rows == 12, "not all four in every forward"
    for rid, case in cases.items():
        image = together[rid].final.as_numpy("image")
        alone = run_request(server.grpc_url, model=model, request_id=f"{rid}-alone", **case)
        assert not alone.errors, alone.errors
        assert image.shape == (1, case["height"], case["width"], 3)
        assert_within_one_level(image, alone.final.as_numpy("image"), rid)


def test_flux_packs_a_taylorseer_row_beside_a_lora_row_of_another_size(server):
    """The per-row features in one packed forward: two FLUX.1 requests of two sizes, one with TaylorSeer (at
    its predicting steps the other computes alone, its text stream one row), one with a LoRA at an FP32 scale.
    They share every forward, none failed and ran again one by one, and each image is within 1 level (in
    <= 0.1 % of values) of the same request served alone."""
    common = dict(num_inference_steps=6, guidance_scale=4.3)
    cases = {"seer-64x64": dict(common, prompt="a red cube", height=64, width=64, seed=1, cache="taylorseer"),
             "lora-32x64": dict(common, prompt="a cat", height=32, width=64, seed=2, lora_name="toy_a",
                                lora_scale=0.7)}
    together, rows = run_together(server, "flux", cases)
    assert rows == 12, "not both in every forward"
    for rid, case in cases.items():
        alone = run_request(server.grpc_url, model="flux", request_id=f"{rid}-alone", **case)
        assert not alone.errors, alone.errors
        assert_within_one_level(together[rid].final.as_numpy("image"), alone.final.as_numpy("image"), rid)


def test_every_model_refuses_inputs_as_parameters_and_huge_scales(server):
    """Request parameters never stand in for inputs (a prompt sent as one was served), and Flux's and SD3's
    guidance scales end at 100 (1e38 gave an all-black image counted as a success)."""
    for model in MODELS:  # with one input: Triton refuses a request with none before the model sees it
        result = run_request(server.grpc_url, model=model, request_id="as-parameter", seed=1,
                             parameters={"prompt": "x"})
        message = result.error.message()
        assert message.startswith("INVALID_ARG: [request id: as-parameter] input 'prompt': must be sent as a tensor"), \
            (model, message)
    for model, scale in (("flux", "guidance_scale"), ("flux", "true_cfg_scale"), ("sd3", "guidance_scale")):
        result = run_request(server.grpc_url, model=model, request_id="huge", prompt="x", **{scale: 1e38})
        message = result.error.message()
        assert message.startswith(f"INVALID_ARG: [request id: huge] input '{scale}': ") and "[0, 100]" in message


def test_sd3_image_to_image_is_diffusers_own_and_hostile_images_are_refused(server, model_dirs):
    """An image (PNG bytes) at strengths 0.2, 0.4, 0.6 and 0.8 of 5 steps (none exactly representable: Triton
    hands them over as FP32) runs 1, 2, 3 and 4 steps and gives StableDiffusion3Img2ImgPipeline's image for the
    Python float, bitwise; random bytes and a decompression bomb (10^10 pixels declared in 70 bytes) get
    INVALID_ARG naming `image`, and the model serves on."""
    from diffusers import StableDiffusion3Img2ImgPipeline

    from engine_lib.config import EngineConfig

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 10**5, 10**5, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(buffer, "PNG")
    picture = buffer.getvalue()
    inputs = dict(prompt="a lighthouse at dusk", height=64, width=64, num_inference_steps=5, seed=2,
                  guidance_scale=1.0, image=picture)
    for rid, image in (("random", np.random.default_rng(2).bytes(512)), ("bomb", bomb)):
        result = run_request(server.grpc_url, model="sd3", request_id=rid, **{**inputs, "image": image})
        assert not result.responses and len(result.errors) == 1
        assert result.error.message().startswith(f"INVALID_ARG: [request id: {rid}] input 'image': "), \
            result.error.message()
    adapter = registry.load_adapter(EngineConfig.of(pipeline="sd3", model_path=str(model_dirs["sd3"]), device="cpu",
                                                    dtype="float32"))
    pipe = StableDiffusion3Img2ImgPipeline(**adapter.pipe.components)
    pipe.set_progress_bar_config(disable=True)
    schema = adapter.input_schema(EngineConfig())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for steps, strength in enumerate((0.2, 0.4, 0.6, 0.8), start=1):
            result = run_request(server.grpc_url, model="sd3", request_id=f"strength-{strength}", **inputs,
                                 strength=strength)
            assert not result.errors and result.num_final == 1, result.errors
            assert int(result.final.as_numpy("num_steps")[0]) == steps, strength
            expected = pipe(**adapter.pipe_kwargs(schema.parse({**inputs, "strength": strength})), output_type="np")
            np.testing.assert_array_equal(result.final.as_numpy("image"), adapter.outputs[0].convert(expected.images),
                                          err_msg=f"strength {strength}")
    finally:
        torch.set_num_threads(threads)


def test_sd3_takes_an_image_in_every_base64_form_and_at_the_byte_and_pixel_limits(server):
    """One PNG as its bytes and as each base64 form clients write (MIME lines, CRLF, spaces, URL-safe, unpadded,
    data: URLs) gives one image, bitwise; a PNG of random pixels between 6 and 8 MiB as MIME base64 (10.4 MB of
    text) and a 4096 x 4096 PNG as an unpadded URL-safe data: URL are served."""
    from tests.helpers.hostile_images import base64_forms, encode, near_the_byte_limit

    picture = encode(Image.fromarray(np.random.default_rng(6).integers(0, 256, (40, 48, 3), dtype=np.uint8)))
    square = encode(Image.new("RGB", (4096, 4096), (30, 60, 90)), compress_level=1)
    cases = {"bytes": picture, **base64_forms(picture), "near-8-MiB": base64_forms(near_the_byte_limit())["mime-lines"],
             "4096x4096": base64_forms(square)["data-url-url-safe-unpadded"]}
    inputs = dict(prompt="a harbour", height=64, width=64, num_inference_steps=5, seed=4, guidance_scale=1.0,
                  strength=0.2)
    results = {name: run_request(server.grpc_url, model="sd3", request_id=name, image=image, **inputs)
               for name, image in cases.items()}
    for name, result in results.items():
        assert not result.errors and result.num_final == 1, (name, result.errors)
        assert int(result.final.as_numpy("num_steps")[0]) == 1, name
    for name in base64_forms(picture):
        np.testing.assert_array_equal(results[name].final.as_numpy("image"), results["bytes"].final.as_numpy("image"),
                                      err_msg=name)


def test_flux_kontext_refuses_a_request_without_its_image_or_with_a_bad_one(server):
    """Kontext edits an image (its served edit is test_served_outputs_are_the_pipelines_own's, on the adapter's
    example image): none, random bytes or an image under the size multiple (8 on the tiny model) get INVALID_ARG
    naming `image`."""
    buffer = io.BytesIO()
    Image.new("RGB", (4, 40)).save(buffer, "PNG")
    for rid, extra in (("none", {}), ("random", {"image": np.random.default_rng(5).bytes(512)}),
                       ("small", {"image": buffer.getvalue(), "auto_resize": 0})):
        result = run_request(server.grpc_url, model="flux_kontext", request_id=rid, prompt="x", **extra)
        assert not result.responses and len(result.errors) == 1
        assert result.error.message().startswith(f"INVALID_ARG: [request id: {rid}] input 'image': "), \
            result.error.message()


def png_of(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 90, 30)).save(buffer, "PNG")
    return buffer.getvalue()


# Images every decoder takes that a pipeline cannot run (each was an INTERNAL error: a division by zero, a side
# resized to 0, the vision encoder's aspect ratio, an H.264 frame of 0 rows): (model, inputs, error fragment).
EXTREME_IMAGES = [
    ("flux_kontext", dict(image=png_of(64, 7), auto_resize=1), "64x7 is too small: at least 8 pixels a side"),
    ("flux_kontext", dict(image=png_of(1, 4096), auto_resize=1), "1x4096 is too small"),
    ("qwen_image_edit", dict(image=png_of(1, 4096)), "1x4096 is too far from square"),
    ("qwen_image_edit", dict(image=png_of(3, 512)), "for the VAE and 64x13376 for the vision encoder"),
    ("qwen_image_edit_plus", dict(image=[png_of(32, 48), png_of(4096, 1)]), "4096x1 is too far from square"),
    ("ltx2", dict(image=png_of(1, 64)), "1x64 is too small: at least 2 pixels a side"),
    ("ltx2", dict(image=png_of(64, 1)), "64x1 is too small"),
]


def test_extreme_but_valid_images_get_invalid_arg_naming_image_and_count_as_invalid(server):
    before = scrape(server.metrics_url)
    for i, (model, inputs, says) in enumerate(EXTREME_IMAGES):
        result = run_request(server.grpc_url, model=model, request_id=f"extreme-{i}", prompt="x", **inputs)
        assert not result.responses and len(result.errors) == 1, (model, says)
        message = result.error.message()
        assert message.startswith(f"INVALID_ARG: [request id: extreme-{i}] input 'image': ") and says in message, \
            message
    for model in {model for model, _, _ in EXTREME_IMAGES}:
        expected = metric(before, "diffusion_requests_total", model=model, outcome="invalid") + \
            sum(case[0] == model for case in EXTREME_IMAGES)
        assert wait_for_metric(server.metrics_url, "diffusion_requests_total", expected, model=model,
                               outcome="invalid") == expected, model


def test_qwen_image_edit_plus_edits_two_images_and_refuses_none_hostile_or_too_many(server):
    """Edit-Plus takes two images (of two aspect ratios) as one [2] input, over gRPC and HTTP JSON; none, random
    bytes beside a good image, or one image more than the bound get INVALID_ARG naming `image` (the last with
    the bound)."""
    from engine_lib.pipelines.qwen_image_edit.adapter import MAX_IMAGES

    pictures = []
    for seed, size in ((1, (48, 32)), (2, (32, 48))):
        buffer = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buffer, "PNG")
        pictures.append(buffer.getvalue())
    inputs = dict(prompt="put them side by side", num_inference_steps=2, seed=1)
    result = run_request(server.grpc_url, model="qwen_image_edit_plus", request_id="two", image=pictures, **inputs)
    assert not result.errors and result.final.as_numpy("image").shape == (1, 64, 64, 3), result.errors
    body = {**inputs, "output_format": "png", "image": [base64.b64encode(p).decode() for p in pictures]}
    status, reply = post_json(f"http://{server.http_url}/v2/models/qwen_image_edit_plus/generate_stream", body)
    assert status == 200 and sse_events(reply)[-1]["is_final"], reply  # a JSON list is the [2] input too
    for rid, extra, says in (("none", {}, "is required"),
                             ("random", {"image": [pictures[0], np.random.default_rng(5).bytes(512)]}, "is not"),
                             ("too-many", {"image": pictures[:1] * (MAX_IMAGES + 1)}, f"1 to {MAX_IMAGES}")):
        result = run_request(server.grpc_url, model="qwen_image_edit_plus", request_id=rid, **inputs, **extra)
        message = result.error.message()
        assert message.startswith(f"INVALID_ARG: [request id: {rid}] input 'image': ") and says in message, message


def test_the_front_door_edits_an_image_as_sd3_does_over_grpc(server, tmp_path):
    """The official SDK's `images.edit` on the front door gives the gRPC image of the same inputs (bitwise; SD3's
    image-to-image, streamed with two partial images too, and FLUX.1 Kontext's edit); a model without an image input is a 400 naming `model`, random bytes a 400 naming `image`, a body over the
    edit cap a 413, and the front door serves on; `images.generate` on Z-Image and FLUX.2 [klein] gives their
    gRPC images too."""
    import openai

    from engine_lib.serving.openai_api.app import MAX_EDIT_BODY_BYTES

    from tests.helpers.front_door import decode, front_door, sdk

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(buffer, "PNG")
    picture = buffer.getvalue()
    extra = {"strength": 0.6, "seed": 1, "num_inference_steps": 4}
    door = front_door(server.grpc_url, tmp_path, OPENAI_API_KEY="")
    try:
        client = sdk(door)
        result = client.images.edit(model="sd3", image=("in.png", picture, "image/png"), prompt="in winter",
                                    size="64x48", extra_body=extra)
        expected = run_request(server.grpc_url, model="sd3", request_id="edit", prompt="in winter", width=64,
                               height=48, image=picture, **extra)
        assert not expected.errors and int(expected.final.as_numpy("num_steps")[0]) == 3  # the last 60% of 4
        np.testing.assert_array_equal(decode(result.data[0].b64_json), expected.final.as_numpy("image")[0])
        events = list(client.images.edit(model="sd3", image=("in.png", picture, "image/png"), prompt="in winter",
                                         size="64x48", stream=True, partial_images=2, extra_body=extra))
        assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
        np.testing.assert_array_equal(decode(events[-1].b64_json), expected.final.as_numpy("image")[0])
        kontext = {"auto_resize": 0, "seed": 1, "num_inference_steps": 2}
        result = client.images.edit(model="flux_kontext", image=("in.png", picture, "image/png"), prompt="in winter",
                                    size="64x48", extra_body=kontext)
        expected = run_request(server.grpc_url, model="flux_kontext", request_id="kontext-edit", prompt="in winter",
                               width=64, height=48, image=picture, **kontext)
        np.testing.assert_array_equal(decode(result.data[0].b64_json), expected.final.as_numpy("image")[0])
        for model, image, param, body in (("flux", picture, "model", extra),
                                          ("sd3", np.random.default_rng(4).bytes(512), "image", extra),
                                          ("qwen_image_edit", png_of(3, 512), "image", {})):  # too far from square
            with pytest.raises(openai.BadRequestError) as info:
                client.images.edit(model=model, image=("in.png", image), prompt="x", extra_body=body)
            assert info.value.param == param, info.value.body
        with pytest.raises(openai.APIStatusError) as info:
            client.images.edit(model="sd3", image=("big.png", b"\0" * MAX_EDIT_BODY_BYTES), prompt="x")
        assert info.value.status_code == 413
        assert "sd3" in [m.id for m in client.models.list()]
        for model, body in (("z_image", {"seed": 2, "num_inference_steps": 3, "guidance_scale": 0.6}),
                            ("flux2", {"seed": 3, "num_inference_steps": 2, "guidance_scale": 2.7})):
            result = client.images.generate(model=model, prompt="a lighthouse", size="64x48", n=2, extra_body=body)
            expected = run_request(server.grpc_url, model=model, request_id=f"{model}-generate", prompt="a lighthouse",
                                   width=64, height=48, num_images=2, **body)
            for served, image in zip(result.data, expected.final.as_numpy("image"), strict=True):
                np.testing.assert_array_equal(decode(served.b64_json), image, err_msg=model)
    finally:
        door.stop()


def test_z_image_serves_turbos_defaults_and_refuses_bad_inputs_by_name(server):
    """A request that leaves steps and guidance out runs Z-Image-Turbo's 8 steps without CFG (the model's config),
    bitwise diffusers' Turbo call; out-of-range inputs get INVALID_ARG naming them, and the server serves on."""
    from engine_lib.config import EngineConfig
    from engine_lib.interface import to_uint8

    adapter = registry.load_adapter(EngineConfig.of(pipeline="z_image", model_path=str(tiny_model_dirs()["z_image"]),
                                                    device="cpu", dtype="float32"))
    result = run_request(server.grpc_url, model="z_image", request_id="turbo", prompt="a red kite", height=48,
                         width=64, seed=5)
    assert not result.errors and int(result.final.as_numpy("num_steps")[0]) == 8, result.errors
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = adapter.pipe("a red kite", height=48, width=64, num_inference_steps=8, guidance_scale=0.0,
                                generator=torch.Generator().manual_seed(5), output_type="np").images
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(result.final.as_numpy("image"), to_uint8(expected))
    for name, value, says in (("guidance_scale", -0.3, "[0, 100]"), ("max_sequence_length", 1025, "[1, 1024]"),
                              ("height", 52, "multiple of 8")):
        bad = run_request(server.grpc_url, model="z_image", request_id=f"bad-{name}", prompt="x",
                          num_inference_steps=2, **{name: value})
        assert bad.num_final == 1 and bad.errors and name in str(bad.errors[0]) and says in str(bad.errors[0]), \
            (name, bad.errors)
    flux2 = run_request(server.grpc_url, model="flux2", request_id="bad-negative", prompt="x", num_inference_steps=2,
                        negative_prompt="blurry")
    assert flux2.errors and "negative_prompt" in str(flux2.errors[0])


def test_sd3_refuses_each_hostile_image_and_mask_by_name_then_inpaints(server):
    """Each hostile file (tests/helpers/hostile_images.py: empty, 20 MB of zeros, decompression bombs, truncated, a GIF of
    500 frames, 16-bit) as `image` and as `mask_image` gets INVALID_ARG naming that input over gRPC, at admission
    (20 MB reach the model here: tritonserver's own gRPC takes it, the launcher's gate would refuse the message
    first); then an inpainting request with a CMYK JPEG image and a palette mask with transparency is served."""
    from tests.helpers.hostile_images import hostile, odd_but_valid

    good = dict(prompt="a red door", height=64, width=64, num_inference_steps=4, seed=3, guidance_scale=1.0,
                strength=0.75, image=odd_but_valid()["cmyk-jpeg"], mask_image=odd_but_valid()["palette-transparent"])
    for name, (data, fragment) in hostile().items():
        for input_name in ("image", "mask_image"):
            rid = f"{name}-{input_name}"
            result = run_request(server.grpc_url, model="sd3", request_id=rid, **{**good, input_name: data})
            assert not result.responses and len(result.errors) == 1, rid
            message = result.error.message()
            assert message.startswith(f"INVALID_ARG: [request id: {rid}] input '{input_name}': ") and \
                fragment in message, message
    result = run_request(server.grpc_url, model="sd3", request_id="inpaint", **good)
    assert not result.errors and result.num_final == 1, result.errors
    assert int(result.final.as_numpy("num_steps")[0]) == 3 and result.final.as_numpy("image").shape == (1, 64, 64, 3)


def test_sd3_rejects_true_cfg_scale_and_flux_rejects_sizes_it_cannot_run(server):
    # sd3's config does not declare true_cfg_scale: Triton refuses it over gRPC, naming it ...
    result = run_request(server.grpc_url, model="sd3", request_id="bad-cfg", prompt="x", true_cfg_scale=4.0)
    assert not result.responses and len(result.errors) == 1
    assert "'true_cfg_scale'" in result.error.message()
    # ... and over HTTP generate_stream (which passes unknown keys on as parameters) the model does.
    status, reply = post_json(f"http://{server.http_url}/v2/models/sd3/generate_stream",
                              {"prompt": "x", "true_cfg_scale": 4.0})
    assert status == 400 and "input 'true_cfg_scale': sd3 does not use this input" in reply.decode(), reply
    result = run_request(server.grpc_url, model="flux", request_id="bad-size", prompt="x", height=36)
    assert result.error.message().startswith("INVALID_ARG: [request id: bad-size] ")
    assert "'height'" in result.error.message()


@pytest.mark.parametrize("model", [m for m in MODELS if "png" in registry.get_adapter_class(m).input_spec(
    "output_format").choices])
def test_http_generate_stream_ends_with_a_decodable_png(server, model):
    previews = registry.get_adapter_class(model).capabilities.supports("previews")
    example = {name: base64.b64encode(value).decode() if isinstance(value, bytes) else value  # JSON: files as base64
               for name, value in registry.get_adapter_class(model).example_inputs().items()}
    height = 64 if model in SIZE_32 else 48
    body = {"prompt": "a blue circle", "height": height, "width": 64, "num_inference_steps": 3,
            "output_format": "png", "seed": 3, **({"preview_interval": 1} if previews else {}), **example}
    status, reply = post_json(f"http://{server.http_url}/v2/models/{model}/generate_stream", body)
    assert status == 200, reply
    events = sse_events(reply)
    assert [e["step"] for e in events] == ([1, 2, 3] if previews else [3])
    assert [e["is_final"] for e in events] == ([False, False, True] if previews else [True])
    image = Image.open(io.BytesIO(base64.b64decode(events[-1]["image_png"])))
    assert image.format == "PNG" and image.size == (64, height)


# Golden case (a) of each own-model pipeline (tests/golden/<model>: the reference implementation's run).
GOLDEN_CASES = {
    "bagel": dict(prompt="a red cube on a blue floor", height=64, width=64, num_inference_steps=5, seed=1,
                  guidance_scale=4.0, cfg_interval=[0.4, 1.0], cfg_renorm_type="global", timestep_shift=3.0),
    "hunyuan_image3": dict(prompt="a red cube on a blue floor", height=64, width=64, num_inference_steps=4, seed=1,
                           guidance_scale=5.0, flow_shift=3.0),
}


@pytest.mark.parametrize("model", GOLDEN_CASES)
def test_own_models_serve_the_reference_image(server, model):
    golden = np.load(REPO_ROOT / "tests" / "golden" / model / "golden.npz")
    result = run_request(server.grpc_url, model=model, request_id="golden-a", **GOLDEN_CASES[model])
    assert not result.errors, result.errors
    image = result.final.as_numpy("image")[0]
    assert np.abs(image.astype(int) - golden["case_a_image_u8"].astype(int)).max() <= 1


@pytest.mark.parametrize("model, sizes", [("bagel", ((64, 64), (32, 64), (48, 48))),
                                          ("hunyuan_image3", ((64, 64), (48, 80), (64, 48)))])
def test_own_models_share_step_batches_across_sizes_and_prompts(server, model, sizes):
    """Three sizes, prompts of different lengths and 4, 3 and 2 steps, held until all three wait: they run
    in 4 ticks, all three in the first two (rows 3 + 3 + 2 + 1), never one by one."""
    prompts = ("a red cube", "a green sphere next to a yellow cone", "a cat")
    cases = {f"{model}-{i}": dict(prompt=prompt, height=height, width=width, num_inference_steps=4 - i, seed=i)
             for i, (prompt, (height, width)) in enumerate(zip(prompts, sizes))}
    results, rows = run_together(server, model, cases)
    assert rows == 9
    for rid, case in cases.items():
        assert results[rid].final.as_numpy("image").shape == (1, case["height"], case["width"], 3)


@pytest.mark.parametrize("inputs, says", [
    (dict(cfg_interval=[0.9, 0.2]), "input 'cfg_interval': start 0.9 is after end 0.2"),
    (dict(cfg_interval=[0.4, 1.0, 1.0]), "cfg_interval"),  # Triton checks the [2] shape
    (dict(height=40), "input 'height'"),
    (dict(cfg_renorm_type="nope"), "input 'cfg_renorm_type'"),
])
def test_bagel_bad_inputs_get_invalid_arg_naming_them(server, inputs, says):
    result = run_request(server.grpc_url, model="bagel", request_id="bad", prompt="x", **inputs)
    assert not result.responses and len(result.errors) == 1
    assert says in result.error.message(), result.error.message()


def test_bagel_answers_in_text_and_thinks_before_its_image(server):
    """The reference's greedy texts (tests/golden/bagel/think.npz): a text request streams its answer's characters,
    then ends with the whole answer and no image; a think request ends with its thought and the image drawn after
    it; a think that is not a BOOL is refused by name; over HTTP generate_stream, JSON true is a BOOL think."""
    golden = np.load(REPO_ROOT / "tests" / "golden" / "bagel" / "think.npz")
    answer = run_request(server.grpc_url, model="bagel", request_id="answer", prompt=str(golden["answer_ends_prompt"]),
                         output_modality="text", max_new_tokens=39)
    assert not answer.errors, answer.errors
    text = answer.final.as_numpy("text")[0].decode("utf-8")
    assert text == str(golden["answer_ends_text"]) and answer.final.as_numpy("image") is None
    chunks = [r.as_numpy("text")[0] for r in answer.responses if r is not answer.final and r.as_numpy("text") is not None]
    assert len(chunks) > 1 and b"".join(chunks).decode("utf-8") == text
    think = run_request(server.grpc_url, model="bagel", request_id="think", prompt=str(golden["think_image_prompt"]),
                        think=True, max_new_tokens=9, height=64, width=64, num_inference_steps=5, seed=1,
                        guidance_scale=4.0)
    assert not think.errors, think.errors
    assert think.final.as_numpy("text")[0].decode("utf-8") == str(golden["think_image_text"])
    image = think.final.as_numpy("image")[0].astype(int)
    assert np.abs(image - golden["think_image_image_u8"].astype(int)).max() <= 1
    bad = run_request(server.grpc_url, model="bagel", request_id="bad-think", prompt="x", think=[True, False])
    assert len(bad.errors) == 1 and "think" in bad.error.message()
    body = {"prompt": str(golden["think_answer_prompt"]), "think": True, "output_modality": "text", "max_new_tokens": 15}
    status, reply = post_json(f"http://{server.http_url}/v2/models/bagel/generate_stream", body)  # JSON true: BOOL
    assert status == 200, reply
    assert sse_events(reply)[-1]["text"] == str(golden["think_answer_text"])


def test_the_front_door_chats_with_bagel_as_grpc_answers_and_returns_its_thought(server, tmp_path):
    """The official SDK's chat completion equals gRPC's `output_modality=text` answer of the same inputs, with its
    finish_reason; streamed, its deltas add up to it; an image with think returns the thought as `revised_prompt`."""
    from tests.helpers.front_door import front_door, sdk

    golden = np.load(REPO_ROOT / "tests" / "golden" / "bagel" / "think.npz")
    expected = run_request(server.grpc_url, model="bagel", request_id="chat", prompt="a red cube",
                           output_modality="text", max_new_tokens=12, temperature=0.0)
    assert not expected.errors, expected.errors
    text = expected.final.as_numpy("text")[0].decode("utf-8")
    door = front_door(server.grpc_url, tmp_path, OPENAI_API_KEY="")
    try:
        client = sdk(door)
        ask = dict(model="bagel", messages=[{"role": "user", "content": "a red cube"}], max_tokens=12, temperature=0)
        answer = client.chat.completions.create(**ask)
        assert answer.choices[0].message.content == text
        assert answer.choices[0].finish_reason == expected.final.as_numpy("finish_reason")[0].decode()
        chunks = list(client.chat.completions.create(**ask, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason
        image = client.images.generate(model="bagel", prompt=str(golden["think_image_prompt"]), size="64x64",
                                       extra_body={"think": True, "max_new_tokens": 9, "num_inference_steps": 2})
        assert image.data[0].revised_prompt == str(golden["think_image_text"])
    finally:
        door.stop()


def test_hunyuan_image3_refuses_a_size_it_would_not_generate_as_asked(server):
    result = run_request(server.grpc_url, model="hunyuan_image3", request_id="bad", prompt="x", height=64, width=32)
    assert not result.responses and len(result.errors) == 1
    assert "input 'height': 64x32 is not one of this model's sizes" in result.error.message()


def test_hunyuan_image3_recaptions_before_its_image(server):
    """The reference's recaption (tests/golden/hunyuan_image3/think.npz) served: the text streamed and whole, with
    its finish_reason, and the image drawn after it within one level; a bot_task it lacks is refused by name."""
    golden = np.load(REPO_ROOT / "tests" / "golden" / "hunyuan_image3" / "think.npz")
    result = run_request(server.grpc_url, model="hunyuan_image3", request_id="recaption", prompt="cat cube old",
                         bot_task="recaption", max_new_tokens=20, height=48, width=80, num_inference_steps=4, seed=2,
                         guidance_scale=3.5)
    assert not result.errors, result.errors
    text = result.final.as_numpy("text")[0].decode("utf-8")
    assert text == str(golden["recaption_ends_cot_text"]) and result.final.as_numpy("finish_reason")[0] == b"stop"
    chunks = [r.as_numpy("text")[0] for r in result.responses if r is not result.final and r.as_numpy("text") is not None]
    assert chunks and b"".join(chunks).decode("utf-8") == text
    image = result.final.as_numpy("image")[0].astype(int)
    assert np.abs(image - golden["recaption_ends_image_u8"].astype(int)).max() <= 1
    bad = run_request(server.grpc_url, model="hunyuan_image3", request_id="bad-task", prompt="x", bot_task="auto")
    assert len(bad.errors) == 1 and "bot_task" in bad.error.message()


# -- video: Helios, streamed chunk by chunk ------------------------------------------------

def test_helios_streams_each_chunk_as_it_is_decoded_then_the_whole_video(server, model_dirs):
    """65 frames = two chunks of 2 steps: progress at steps 1 and 3, a chunk at steps 2 and 4, then the final
    video, which is the chunks end to end and the pipeline's own; frames are counted in the metrics."""
    from tests.helpers.streaming import metric, scrape, wait_for_metric

    labels = dict(model="helios")
    frames_before = metric(scrape(server.metrics_url), "diffusion_frames_generated_total", **labels)
    inputs = dict(prompt="a boat on a lake", height=32, width=48, num_frames=65, num_inference_steps=2, seed=7)
    result = run_request(server.grpc_url, model="helios", request_id="chunks", preview_interval=1, **inputs)
    assert not result.errors and result.num_final == 1, result.errors
    assert result.steps() == [1, 2, 3, 4, 4]
    chunks = [r for r in result.responses[:-1] if r.as_numpy("video") is not None]
    assert [int(c.as_numpy("frame_offset")[0]) for c in chunks] == [0, 33]
    assert [int(c.as_numpy("step")[0]) for c in chunks] == [2, 4]
    video = result.final.as_numpy("video")
    assert video.dtype == np.uint8 and video.shape == (1, 65, 32, 48, 3)
    np.testing.assert_array_equal(np.concatenate([c.as_numpy("video") for c in chunks], axis=1), video)
    assert float(result.final.as_numpy("frame_rate")[0]) == 24.0

    from engine_lib.config import EngineConfig

    adapter = registry.load_adapter(EngineConfig.of(pipeline="helios", model_path=str(model_dirs["helios"]),
                                                    device="cpu", dtype="float32"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = adapter.pipe(**adapter.pipe_kwargs(adapter.input_schema(EngineConfig()).parse(inputs)),
                                output_type="np").frames
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(video, (np.clip(expected, 0, 1) * 255).round().astype(np.uint8))
    assert wait_for_metric(server.metrics_url, "diffusion_frames_generated_total", frames_before + 65,
                           **labels) == frames_before + 65


def test_helios_mp4_over_grpc_and_http_decodes_to_the_asked_frames(server):
    from engine_lib.serving.mp4 import probe_mp4

    result = run_request(server.grpc_url, model="helios", request_id="mp4", prompt="a kite", num_frames=33,
                         num_inference_steps=2, output_format="mp4")
    assert not result.errors, result.errors
    [mp4] = result.final.as_numpy("video_mp4")
    assert probe_mp4(base64.b64decode(mp4)) == {"frames": 33, "height": 64, "width": 64, "audio_streams": 0}
    body = {"prompt": "a kite", "num_frames": 65, "num_inference_steps": 1, "height": 32, "width": 32,
            "output_format": "mp4"}
    status, reply = post_json(f"http://{server.http_url}/v2/models/helios/generate_stream", body)
    assert status == 200, reply
    events = sse_events(reply)
    assert [e.get("frame_offset") for e in events] == [0, 33, None]  # a [1] tensor is a JSON scalar
    clips = [probe_mp4(base64.b64decode(e["video_mp4"])) for e in events]
    assert [c["frames"] for c in clips] == [33, 32, 65] and clips[-1]["height"] == 32


@pytest.mark.parametrize("inputs, says", [
    (dict(num_frames=40), "input 'num_frames': 40 is not a length helios generates (whole chunks of 33 frames); "
                          "nearest: 33 or 65"),
    (dict(num_frames=10_000), "input 'num_frames': 10000 is outside the allowed range [1, 257]"),
    (dict(height=2048), "input 'height'"),
    (dict(output_format="png"), "input 'output_format': 'png' is not one of: raw, mp4"),
])
def test_helios_refuses_bad_and_oversize_requests_naming_the_input(server, inputs, says):
    result = run_request(server.grpc_url, model="helios", request_id="bad", prompt="x", **inputs)
    assert not result.responses and len(result.errors) == 1
    assert result.error.message().startswith("INVALID_ARG: [request id: bad] ")
    assert says in result.error.message(), result.error.message()


@pytest.mark.parametrize("model, suffix, protocol", [("helios", ".mp4", "grpc"), ("helios", ".mp4", "http"),
                                                     ("helios", ".npy", "grpc"), ("ltx2", ".mp4", "grpc"),
                                                     ("ltx2", ".wav", "grpc")])
def test_the_client_saves_a_video_and_names_each_chunk(server, tmp_path, model, suffix, protocol):
    """`python -m client generate --model helios --frames 65 --out clip.mp4` (and .npy raw frames; LTX-2 with
    --fps, an mp4 with sound and the sound alone as .wav), over gRPC and HTTP."""
    import subprocess
    import sys
    import wave

    from engine_lib.serving.mp4 import probe_mp4

    out = tmp_path / f"clip{suffix}"
    url = server.grpc_url if protocol == "grpc" else server.http_url
    frames = 65 if model == "helios" else 9
    proc = subprocess.run([sys.executable, "-m", "client", "generate", "--model", model, "--prompt", "a kite",
                           "--frames", str(frames), "--steps", "1", "--size", "32", "--seed", "2", "--out", str(out),
                           "--url", url, *(["--http"] if protocol == "http" else []),
                           *(["--fps", "12"] if model == "ltx2" else [])],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"saved {out} in ")
    notes = [line.split("s ", 1)[-1] for line in proc.stderr.splitlines() if "chunk" in line]
    if suffix == ".npy":
        assert np.load(out).shape == (1, 65, 32, 32, 3)
        assert notes == ["chunk: frames 0-32", "chunk: frames 33-64"]
    elif suffix == ".wav":
        with wave.open(str(out)) as wav:
            assert (wav.getnchannels(), wav.getframerate()) == (2, 16000) and wav.getnframes() > 0
    else:
        clip = probe_mp4(out.read_bytes())
        assert clip["frames"] == frames and clip["audio_streams"] == (1 if model == "ltx2" else 0)
        assert notes == (["chunk from frame 0", "chunk from frame 33"] if model == "helios" else [])


# -- video with sound: LTX-2 --------------------------------------------------------------------

def test_ltx2_step_batches_requests_with_different_guidance(server):
    """Three concurrent requests (CFG+STG+modality, none, STG only; different step counts) share step batches."""
    unguided = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                    modality_scale=1.0, audio_modality_scale=1.0)
    cases = [dict(prompt="a dog", height=32, width=32, num_inference_steps=3, seed=1, preview_interval=1),
             dict(prompt="a cat", height=32, width=32, num_inference_steps=2, seed=2, **unguided),
             dict(prompt="rain", height=32, width=32, num_inference_steps=4, seed=3, **{**unguided, "stg_scale": 0.5})]
    results = run_concurrently(server.grpc_url, cases, prefix="ltx2-", model="ltx2")
    for case, result in zip(cases, results):
        assert not result.errors and result.num_final == 1, result.errors
        assert result.final.as_numpy("video").shape == (1, 9, 32, 32, 3)
        audio = result.final.as_numpy("audio")
        assert audio.dtype == np.float32 and audio.shape[:2] == (1, 2)
        assert int(result.final.as_numpy("audio_sample_rate")[0]) == 16000
    assert results[0].steps() == [1, 2, 3]  # progress at steps 1 and 2, then the final


def test_ltx2_mp4_carries_the_video_and_its_sound_over_grpc_and_http(server):
    from engine_lib.serving.mp4 import probe_mp4

    result = run_request(server.grpc_url, model="ltx2", request_id="mp4", prompt="a waterfall", num_frames=17,
                         height=32, width=64, num_inference_steps=2, frame_rate=12.0, output_format="mp4")
    assert not result.errors, result.errors
    [mp4] = result.final.as_numpy("video_mp4")
    assert probe_mp4(base64.b64decode(mp4)) == {"frames": 17, "height": 32, "width": 64, "audio_streams": 1}
    body = {"prompt": "a waterfall", "num_frames": 9, "height": 32, "width": 32, "num_inference_steps": 1,
            "output_format": "mp4"}
    status, reply = post_json(f"http://{server.http_url}/v2/models/ltx2/generate_stream", body)
    assert status == 200, reply
    [event] = sse_events(reply)
    assert probe_mp4(base64.b64decode(event["video_mp4"]))["audio_streams"] == 1
    assert event["frame_rate"] == 24.0 and event["audio_sample_rate"] == 16000


@pytest.mark.parametrize("inputs, says", [
    (dict(num_frames=12), "input 'num_frames': 12 must be 8k + 1 (the VAE compresses 8 frames into one latent "
                          "frame); nearest: 9 or 17"),
    (dict(num_frames=1001), "input 'num_frames': 1001 is outside the allowed range [1, 257]"),
    (dict(width=4096), "input 'width'"),
    (dict(frame_rate=0.0), "input 'frame_rate'"),
    (dict(stg_scale=-1.0), "input 'stg_scale'"),
    (dict(height=1024, width=1024, num_frames=257), "input 'num_frames': height x width x num_frames = 1024 x 1024 x "
                                                    "257 costs 1081344 latent tokens x rows per forward, above this "
                                                    "model's max_request_cost 786432"),
])
def test_ltx2_refuses_bad_and_oversize_requests_naming_the_input(server, inputs, says):
    result = run_request(server.grpc_url, model="ltx2", request_id="bad", prompt="x", **inputs)
    assert not result.responses and len(result.errors) == 1
    assert result.error.message().startswith("INVALID_ARG: [request id: bad] ")
    assert says in result.error.message(), result.error.message()


def test_ltx2_image_to_video_from_the_client_is_diffusers_own_and_a_bad_image_is_refused(server, model_dirs, tmp_path):
    """`python -m client generate --model ltx2 --image in.png` streams progress and saves
    LTX2ImageToVideoPipeline's video (raw frames, bitwise); random bytes as `image` get INVALID_ARG naming it."""
    import subprocess
    import sys

    from diffusers import LTX2ImageToVideoPipeline

    from engine_lib.config import EngineConfig

    result = run_request(server.grpc_url, model="ltx2", request_id="bad-image", prompt="x", height=32, width=32,
                         image=np.random.default_rng(3).bytes(512))
    assert not result.responses and len(result.errors) == 1
    assert result.error.message().startswith("INVALID_ARG: [request id: bad-image] input 'image': ")
    picture, out = tmp_path / "in.png", tmp_path / "clip.npy"
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(picture)
    proc = subprocess.run([sys.executable, "-m", "client", "generate", "--model", "ltx2", "--prompt", "a kite",
                           "--image", str(picture), "--frames", "9", "--steps", "2", "--size", "32", "--seed", "2",
                           "--out", str(out), "--url", server.grpc_url],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step 1/2" in proc.stderr  # a progress response before the final one
    adapter = registry.load_adapter(EngineConfig.of(pipeline="ltx2", model_path=str(model_dirs["ltx2"]), device="cpu",
                                                    dtype="float32"))
    pipe = LTX2ImageToVideoPipeline(**adapter.pipe.components)
    pipe.set_progress_bar_config(disable=True)
    inputs = dict(prompt="a kite", image=picture.read_bytes(), num_frames=9, num_inference_steps=2, height=32,
                  width=32, seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = pipe(**adapter.pipe_kwargs(adapter.input_schema(EngineConfig()).parse(inputs)), output_type="np")
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(np.load(out), adapter.outputs[0].convert(expected.frames))


def _cancel_and_check_freed(server, stream, model: str, within_s: float) -> None:
    """Cancel `stream`'s request: the model logs it cancelled within `within_s`, then holds nothing for it."""
    import re
    import time

    cancelled_at = time.monotonic()
    stream.cancel()
    while not re.search(rf"{model}: cancelled request {re.escape(stream.request_id)}", server.log_text()):
        assert time.monotonic() - cancelled_at < within_s, server.log_tail(20)
        time.sleep(0.02)
    for gauge in ("diffusion_requests_running", "diffusion_runner_states", "diffusion_open_streams"):
        assert wait_for_metric(server.metrics_url, gauge, 0.0, model=model) == 0.0, gauge


def test_a_long_ltx2_tick_is_cancelled_within_2_s_and_the_model_serves_the_next_request(server):
    """SLOW_PROMPT's ticks sleep 1 s per block: its first one (encoding, then a step of three transformer passes)
    passes 12 block boundaries, 12 s. Cancelled inside it, the request ends within 2 s: the tick stopped between
    two blocks."""
    import time

    stream = RequestStream(server.grpc_url).send("slow-tick", model="ltx2", prompt=SLOW_PROMPT, height=32, width=32,
                                                 num_frames=9, num_inference_steps=2)
    try:
        assert wait_for_metric(server.metrics_url, "diffusion_requests_running", 1.0, model="ltx2") == 1.0
        time.sleep(1.0)  # inside its first tick (running from the tick's start): 11 s of it left
        _cancel_and_check_freed(server, stream, "ltx2", within_s=2.0)
    finally:
        close_all([stream])
    after = run_request(server.grpc_url, model="ltx2", request_id="after-slow", prompt="x", height=32, width=32,
                        num_frames=9, num_inference_steps=1, output_format="raw")
    assert not after.errors and after.final.as_numpy("video").shape == (1, 9, 32, 32, 3)


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the SDK's own deprecation of videos
def test_the_front_door_video_jobs_run_ltx2_and_deleting_one_cancels_its_request(server, tmp_path):
    """The official SDK's `videos.create`, polled with `retrieve`, ends with an mp4 of the asked frames (1 s at
    8 fps: 9) and its sound track; deleting a running job cancels its Triton request (the model counts it). A Wan job
    beside it: 1 s at Wan's own 16 frames per second is 17 frames (its 4k + 1), with no sound track."""
    import openai

    from engine_lib.serving.mp4 import probe_mp4

    from tests.helpers.front_door import front_door, sdk

    door = front_door(server.grpc_url, tmp_path, OPENAI_API_KEY="")
    try:
        client = sdk(door)
        video = client.videos.create(model="ltx2", prompt="a waterfall", size="64x32", seconds="1",
                                     extra_body={"frame_rate": 8, "num_inference_steps": 2, "seed": 1})
        assert video.status in ("queued", "in_progress") and video.seconds == "1"
        wan = client.videos.create(model="wan", prompt="a lighthouse", size="48x32", seconds="1",
                                   extra_body={"num_inference_steps": 2, "seed": 1, "guidance_scale": 1.0})
        done = client.videos.poll(video.id, poll_interval_ms=100)  # retrieve until it is completed or failed
        assert done.status == "completed" and done.progress == 100, done.error
        mp4 = client.videos.download_content(video.id).content
        assert probe_mp4(mp4) == {"frames": 9, "height": 32, "width": 64, "audio_streams": 1}
        assert client.videos.poll(wan.id, poll_interval_ms=100).status == "completed"
        assert probe_mp4(client.videos.download_content(wan.id).content) == \
            {"frames": 17, "height": 32, "width": 48, "audio_streams": 0}
        cancelled = metric(scrape(server.metrics_url), "diffusion_requests_total", model="ltx2", outcome="cancelled")
        slow = client.videos.create(model="ltx2", prompt=SLOW_PROMPT, size="32x32", seconds="1",
                                    extra_body={"frame_rate": 8, "num_inference_steps": 2})
        assert wait_for_metric(server.metrics_url, "diffusion_requests_running", 1.0, model="ltx2") == 1.0
        assert client.videos.retrieve(slow.id).status in ("queued", "in_progress")
        assert client.videos.delete(slow.id).deleted
        assert wait_for_metric(server.metrics_url, "diffusion_requests_total", cancelled + 1, model="ltx2",
                               outcome="cancelled") == cancelled + 1
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(slow.id)
    finally:
        door.stop()


def test_the_openai_images_front_door_offers_only_the_image_models(server):
    import asyncio

    from engine_lib.serving.openai_api.gateway import TritonGateway

    async def ready():
        gateway = TritonGateway(server.grpc_url, admin_key="")
        try:
            return await gateway.ready_models()
        finally:
            await gateway.close()

    videos = {name for name in MODELS if registry.get_adapter_class(name).outputs[0].name == "video"}
    assert videos == {"helios", "ltx2", "wan", "wan_i2v"}
    assert asyncio.run(ready()) == sorted(set(MODELS) - videos)


def test_a_helios_request_cancelled_after_its_first_chunk_frees_everything(server):
    """229 frames = seven chunks of 20 steps: cancelled once the first chunk arrives (six chunks still to run),
    the request ends CANCELLED, the model holds nothing for it, and the next request is served."""
    stream = RequestStream(server.grpc_url).send("long-video", model="helios", prompt="a long river", height=32,
                                                 width=32, num_frames=229, num_inference_steps=20)
    try:
        first = stream.wait_first(timeout=60)
        assert not first.errors and int(first.responses[0].as_numpy("frame_offset")[0]) == 0
        _cancel_and_check_freed(server, stream, "helios", within_s=5.0)
    finally:
        close_all([stream])
    after = run_request(server.grpc_url, model="helios", request_id="after", prompt="x", height=32, width=32,
                        num_inference_steps=1)
    assert not after.errors and after.final.as_numpy("video").shape == (1, 33, 32, 32, 3)


def ltx2_job(client, prompt: str = "a waterfall"):
    return client.videos.create(model="ltx2", prompt=prompt, size="64x32", seconds="1",
                                extra_body={"frame_rate": 8, "num_inference_steps": 2, "seed": 3})


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_video_jobs_outlive_a_front_door_killed_mid_job(server, tmp_path):
    """SIGKILL of the front door (the process that runs the jobs) while a job runs, then a new one on the same
    DIFFUSION_DATA_DIR: the completed job is listed, retrieved and downloaded with the same bytes, and the one
    that was running is `failed` with "server restarted" at once."""
    from tests.helpers.front_door import front_door, sdk

    env = {"OPENAI_API_KEY": "", "DIFFUSION_DATA_DIR": str(tmp_path / "data")}
    door = front_door(server.grpc_url, tmp_path, **env)
    try:
        client = sdk(door)
        done = client.videos.poll(ltx2_job(client).id, poll_interval_ms=100)
        assert done.status == "completed", done.error
        mp4 = client.videos.download_content(done.id).content
        slow = ltx2_job(client, SLOW_PROMPT)
        assert wait_for_metric(server.metrics_url, "diffusion_requests_running", 1.0, model="ltx2") == 1.0
        door.process.kill()
        door.process.wait(10)
    finally:
        door.stop()
    again = front_door(server.grpc_url, tmp_path, **env)
    try:
        client = sdk(again)
        assert [v.id for v in client.videos.list(order="asc")] == [done.id, slow.id]
        assert client.videos.retrieve(done.id).status == "completed"
        assert client.videos.download_content(done.id).content == mp4
        failed = client.videos.retrieve(slow.id)
        assert failed.status == "failed" and failed.error.message == "server restarted", failed
    finally:
        again.stop()


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_two_front_doors_on_one_postgresql_store_answer_for_each_others_jobs(server, tmp_path):
    """Replicas: a job created through A is retrieved, downloaded and deleted through B (a real PostgreSQL
    server, the mp4s on one shared folder)."""
    import openai

    from tests.helpers.postgres import postgres_bin, throwaway_cluster
    from tests.helpers.front_door import front_door, sdk

    if postgres_bin() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl): scripts/setup.sh installs Debian's postgresql")
    with throwaway_cluster(postgres_bin()) as url:
        env = {"OPENAI_API_KEY": "", "DIFFUSION_DATA_DIR": str(tmp_path / "shared"), "JOB_STORE_URL": url}
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
        doors = [front_door(server.grpc_url, tmp_path / name, **env) for name in ("a", "b")]
        try:
            a, b = (sdk(door) for door in doors)
            video = ltx2_job(a)
            done = b.videos.poll(video.id, poll_interval_ms=100)
            assert done.status == "completed" and done.progress == 100, done.error
            assert b.videos.download_content(video.id).content == a.videos.download_content(video.id).content
            assert [v.id for v in b.videos.list()] == [video.id]
            assert b.videos.delete(video.id).deleted
            with pytest.raises(openai.NotFoundError):
                a.videos.retrieve(video.id)
            assert list((tmp_path / "shared" / "artifacts").iterdir()) == []
        finally:
            for door in doors:
                door.stop()


# -- video: Wan (two experts) -------------------------------------------------------------------

def test_wan_serves_both_experts_at_fp32_scales_as_diffusers_and_as_mp4(server, model_dirs):
    """4 steps cross the tiny Wan2.2's boundary (3 high-noise, 1 low-noise step); 3.3 and 0.7 arrive as FP32 and
    give what diffusers gives with those Python floats, bit for bit; the same request as mp4 holds 9 frames."""
    from engine_lib.config import EngineConfig
    from engine_lib.serving.mp4 import probe_mp4

    inputs = dict(prompt="a red kite over the sea", height=32, width=48, num_frames=9, num_inference_steps=4, seed=5,
                  guidance_scale=3.3, guidance_scale_2=0.7, negative_prompt="blurry")
    result = run_request(server.grpc_url, model="wan", request_id="wan-raw", **inputs)
    assert not result.errors and result.num_final == 1, result.errors
    adapter = registry.load_adapter(EngineConfig.of(pipeline="wan", model_path=str(model_dirs["wan"]), device="cpu",
                                                    dtype="float32"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = adapter.pipe(**{**adapter.pipe_kwargs(adapter.input_schema(EngineConfig()).parse(inputs)),
                                   "guidance_scale": 3.3, "guidance_scale_2": 0.7}, output_type="np").frames
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(result.final.as_numpy("video"), (np.clip(expected, 0, 1) * 255).round().astype(np.uint8))
    assert float(result.final.as_numpy("frame_rate")[0]) == 16.0
    mp4 = run_request(server.grpc_url, model="wan", request_id="wan-mp4", output_format="mp4", **inputs)
    assert not mp4.errors, mp4.errors
    assert probe_mp4(base64.b64decode(mp4.final.as_numpy("video_mp4")[0])) == \
        {"frames": 9, "height": 32, "width": 48, "audio_streams": 0}


@pytest.mark.parametrize("model, inputs, says", [
    ("wan", dict(num_frames=10), "input 'num_frames': 10 must be 4k + 1 (the VAE compresses 4 frames into one latent "
                                 "frame); nearest: 9 or 13"),
    ("wan", dict(height=40), "input 'height': 40 must be a multiple of 16"),
    ("wan", dict(guidance_scale_2=1e38), "input 'guidance_scale_2': "),
    ("wan_i2v", dict(), "input 'image': is required"),
    ("wan_i2v", dict(image=b"\x89PNG\r\n\x1a\n truncated"), "input 'image': "),
])
def test_wan_refuses_bad_inputs_naming_them(server, model, inputs, says):
    result = run_request(server.grpc_url, model=model, request_id="bad", prompt="x", **inputs)
    assert not result.responses and len(result.errors) == 1
    assert result.error.message().startswith(f"INVALID_ARG: [request id: bad] {says}"), result.error.message()
