"""Client tests that need no Triton server: arguments, inputs, SSE parsing,
response decoding, the HTTP transport against a canned event stream, and the
CLI's one-line message when no server listens.
"""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from client import Final, Progress, ServerError, build_inputs, generate, stream
from client.__main__ import output_paths, parse_args
from client.decode import decode_response
from client.events import ResponseFormatError
from client.grpc_transport import _infer_inputs
from client.sse import iter_sse_data

ROOT = Path(__file__).resolve().parents[2]


def _png(color=(255, 0, 0), size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- arguments and inputs ------------------------------------------------------------
def test_size_sets_height_and_width_and_unset_options_stay_none():
    args = parse_args(["generate", "--prompt", "a cat", "--size", "64", "--steps", "3", "--seed", "7"])
    assert (args.height, args.width, args.steps, args.seed) == (64, 64, 3, 7)
    assert args.negative_prompt is None and args.true_cfg_scale is None and args.num_images is None
    assert not args.http and args.model == "qwen_image"


@pytest.mark.parametrize(
    "argv",
    [
        ["--size", "64", "--height", "32"],  # ambiguous size
        ["--preview-every", "-1"],
        ["--steps", "0"],
        ["--size", "-8"],
        ["--http", "--out", "clip.npy"],  # raw tensors arrive flat over HTTP
    ],
)
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["generate", "--prompt", "x", *argv])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_only_inputs_the_user_set_are_sent():
    assert build_inputs("p") == {"prompt": "p"}
    inputs = build_inputs("p", steps=5, height=32, true_cfg_scale=4.0, preview_interval=0, seed=0)
    assert inputs == {"prompt": "p", "num_inference_steps": 5, "height": 32, "true_cfg_scale": 4.0, "seed": 0}
    assert build_inputs("p", preview_interval=2, output_format="png")["preview_interval"] == 2
    image = build_inputs("p", image=_png(), strength=0.6)  # base64 text: one form for gRPC and HTTP JSON
    assert base64.b64decode(image["image"]) == _png() and image["strength"] == 0.6
    args = parse_args(["generate", "--prompt", "x", "--image", "in.png", "--strength", "0.6", "--model", "sd3"])
    assert (args.image, args.strength) == ([Path("in.png")], 0.6)
    several = build_inputs("p", image=[_png(), b"second"])["image"]  # qwen_image_edit_plus: one [2] input
    assert [base64.b64decode(text) for text in several] == [_png(), b"second"]
    tensor, = _infer_inputs({"image": several}, {"image": "BYTES"})
    assert tensor.shape() == [2]
    assert base64.b64decode(build_inputs("p", image=_png(), mask=b"m")["mask_image"]) == b"m"
    assert parse_args(["generate", "--prompt", "x", "--image", "i.png", "--mask", "m.png"]).mask == Path("m.png")
    args = parse_args(["generate", "--prompt", "x", "--cache", "first_block", "--cache-threshold", "0.1"])
    assert (args.cache, args.cache_threshold) == ("first_block", 0.1)
    cached = build_inputs("p", cache=args.cache, cache_threshold=args.cache_threshold)
    assert (cached["cache"], cached["cache_threshold"]) == ("first_block", 0.1)
    assert parse_args(["generate", "--prompt", "x", "--cache", "taylorseer"]).cache == "taylorseer"


def test_several_images_get_numbered_paths():
    assert output_paths(Path("out.png"), 1) == [Path("out.png")]
    assert output_paths(Path("d/out.png"), 2) == [Path("d/out-0.png"), Path("d/out-1.png")]


# -- SSE and response decoding -----------------------------------------------------------
def test_sse_parser_yields_each_data_event():
    canned = [
        b": keep-alive comment\n",
        b'data: {"step": 1}\r\n',
        b"\r\n",
        b"event: message\n",
        b"data: line one\n",
        b"data: line two\n",
        b"\n",
        b"\n",
        b'data: {"last": true}',  # the server closed without the blank line
    ]
    assert list(iter_sse_data(canned)) == ['{"step": 1}', "line one\nline two", '{"last": true}']


def test_decode_raw_png_and_base64_outputs():
    raw = np.zeros((2, 4, 6, 3), dtype=np.uint8)
    raw[1] = 200
    event = decode_response({"image": raw, "step": np.array([3]), "num_steps": np.array([3]),
                             "is_final": np.array([True])}, is_last=True)
    assert isinstance(event, Final) and len(event.images) == 2
    assert event.images[0].size == (6, 4) and event.images[1].getpixel((0, 0)) == (200, 200, 200)

    png = _png((0, 255, 0))
    grpc_like = decode_response({"image_png": np.array([png], dtype=object), "is_final": np.array([True])},
                                is_last=False)
    json_like = decode_response({"image_png": [base64.b64encode(png).decode()], "is_final": True}, is_last=False)
    for event in (grpc_like, json_like):
        assert isinstance(event, Final) and event.images[0].getpixel((0, 0)) == (0, 255, 0)


def test_decode_progress_with_and_without_preview():
    plain = decode_response({"step": [2], "num_steps": [10], "is_final": [False]}, is_last=False)
    assert plain == Progress(step=2, num_steps=10, previews=None)
    preview = decode_response({"step": 4, "num_steps": 10, "is_final": False,
                               "image": [[[[1, 2, 3]] * 5] * 4]}, is_last=False)
    assert isinstance(preview, Progress) and preview.previews[0].size == (5, 4)
    assert decode_response({}, is_last=True) is None  # Triton's flags-only last response


def test_final_without_image_is_an_error():
    with pytest.raises(ResponseFormatError, match="no image"):
        decode_response({"is_final": [True], "step": [1], "num_steps": [1]}, is_last=True)


# -- HTTP transport against a canned generate_stream ---------------------------------------
class _CannedTriton(BaseHTTPRequestHandler):
    """Answers generate_stream with the canned events of the model named in the URL."""

    streams = {
        "ok": [
            {"step": 1, "num_steps": 2, "is_final": False},
            {"step": 2, "num_steps": 2, "is_final": False},
            {"step": 2, "num_steps": 2, "is_final": True, "image_png": base64.b64encode(_png()).decode()},
        ],
        "fails_midway": [
            {"step": 1, "num_steps": 2, "is_final": False},
            {"error": "input 'height': 4097 is out of range [16, 1024]"},
        ],
        "no_final": [{"step": 1, "num_steps": 2, "is_final": False}],
        "answers": [  # BAGEL's text answer: new characters, then the whole text (its last piece never streamed)
            {"step": 1, "num_steps": 3, "is_final": False, "text": "Hel"},
            {"step": 2, "num_steps": 3, "is_final": False, "text": "lo, "},
            {"step": 3, "num_steps": 3, "is_final": True, "text": "Hello, world", "finish_reason": "length"},
        ],
    }
    requests: list = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        model = self.path.split("/")[3]
        if model not in self.streams:
            payload = json.dumps({"error": f"Request for unknown model: '{model}' is not found"}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.end_headers()
        for event in self.streams[model]:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def canned_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CannedTriton)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_stream_yields_progress_then_final(canned_server):
    _CannedTriton.requests.clear()
    events = list(stream("a cat", protocol="http", url=canned_server, model="ok", steps=2, seed=3))
    assert [type(e) for e in events] == [Progress, Progress, Final]
    assert (events[0].step, events[0].num_steps) == (1, 2)
    assert events[-1].images[0].size == (8, 6)
    path, body = _CannedTriton.requests[0]
    assert path == "/v2/models/ok/generate_stream"
    # unset inputs are not sent; HTTP asks for PNG
    assert body == {"prompt": "a cat", "num_inference_steps": 2, "seed": 3, "output_format": "png"}


def test_http_errors_carry_tritons_message(canned_server):
    with pytest.raises(ServerError, match=r"input 'height': 4097 is out of range"):
        generate("x", protocol="http", url=f"http://{canned_server}", model="fails_midway")
    with pytest.raises(ServerError, match="unknown model") as exc:
        generate("x", protocol="http", url=canned_server, model="missing")
    assert exc.value.status == "400"
    with pytest.raises(ServerError, match="without a final image"):
        generate("x", protocol="http", url=canned_server, model="no_final")


# -- no server ------------------------------------------------------------------------------
def test_the_cli_prints_a_text_answer_as_it_streams(canned_server, capsys):
    from client.__main__ import main

    _CannedTriton.requests.clear()
    assert main(["generate", "--prompt", "hi", "--http", "--url", canned_server, "--model", "answers", "--think",
                 "--output-modality", "text", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert out.out == "Hello, world\n" and "answered (length)" in out.err
    assert _CannedTriton.requests[0][1] == {"prompt": "hi", "think": True, "output_modality": "text",
                                            "max_new_tokens": 5, "temperature": 0.0, "output_format": "png"}
    tensor, = _infer_inputs({"think": True}, {"think": "BOOL"})  # gRPC: a BOOL tensor, as the model declares
    assert tensor.datatype() == "BOOL"
    final = decode_response({"text": np.array([b"ok"], dtype=object), "finish_reason": np.array([b"stop"], dtype=object),
                             "is_final": np.array([True])}, is_last=True)
    assert (final.text, final.finish_reason, final.images) == ("ok", "stop", [])


@pytest.mark.parametrize("protocol_args", [[], ["--http"]], ids=["grpc", "http"])
def test_unreachable_server_gives_one_clear_line(protocol_args, tmp_path):
    port = _free_port()
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "client", "generate", "--prompt", "x", "--url", f"127.0.0.1:{port}",
         "--out", str(tmp_path / "out.png"), *protocol_args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach Triton at 127.0.0.1:"), proc.stderr
    assert time.monotonic() - started < 30  # loose: no connection retries for minutes
    assert not (tmp_path / "out.png").exists()


# -- against a real tritonserver (tiny Qwen-Image) ----------------------------------------------
def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client", "generate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, **kwargs)


@pytest.fixture
def triton(server):
    """The session's shared server (tests/conftest.py): the shipped qwen_image configuration on the tiny model."""
    return server


def test_cli_grpc_saves_the_image_and_previews(triton, tmp_path):
    out, previews = tmp_path / "out.png", tmp_path / "previews"
    proc = _cli("--prompt", "a red bicycle", "--height", "32", "--width", "48", "--steps", "3", "--seed", "5",
                "--preview-every", "1", "--preview-dir", str(previews), "--out", str(out), "--url", triton.grpc_url)
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(rf"saved {re.escape(str(out))} \(48x32\) in \d+\.\d+ s\n", proc.stdout)
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (48, 32)
    # a preview after steps 1 and 2; step 3 is the final image
    assert sorted(p.name for p in previews.iterdir()) == ["step-0001.png", "step-0002.png"]
    assert Image.open(previews / "step-0001.png").size == (48, 32)
    assert "step 3/3" in proc.stderr.splitlines()[-1]


def test_cli_http_gives_the_same_image_as_grpc(triton, tmp_path):
    common = ["--prompt", "same seed", "--size", "32", "--steps", "2", "--seed", "11"]
    grpc_run = _cli(*common, "--out", str(tmp_path / "grpc.png"), "--url", triton.grpc_url)
    http_run = _cli(*common, "--out", str(tmp_path / "http.png"), "--url", triton.http_url, "--http")
    assert grpc_run.returncode == 0 and http_run.returncode == 0, grpc_run.stderr + http_run.stderr
    grpc_image = np.asarray(Image.open(tmp_path / "grpc.png"))
    http_image = np.asarray(Image.open(tmp_path / "http.png"))
    assert grpc_image.shape == (32, 32, 3) and np.array_equal(grpc_image, http_image)


def test_a_stream_left_early_cancels_its_request_and_leaves_no_thread(triton):
    """Closing `stream()` before the final event cancels the request on the server; the gRPC transport
    also ends the thread tritonclient 2.50 leaves blocked after a cancel (grpc_transport.stop_stream)."""
    import threading

    from client import stream

    def cancelled() -> int:
        return triton.log_text().count("qwen_image: cancelled request")

    before = set(threading.enumerate())
    try:
        for i in range(3):
            cancelled_before = cancelled()
            triton.budget.allow(1)  # exactly the request's first step; then the engine holds
            events = stream("left early", url=triton.grpc_url, steps=50, height=32, width=32, preview_interval=1,
                            timeout=60)
            assert next(events).step == 1
            events.close()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and cancelled() < cancelled_before + 1:
                time.sleep(0.05)
            assert cancelled() == cancelled_before + 1, f"stream {i}: no cancellation reached the server"
    finally:
        triton.budget.release()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not set(threading.enumerate()) <= before:
        time.sleep(0.05)
    assert set(threading.enumerate()) <= before, [t.name for t in set(threading.enumerate()) - before]


def test_api_several_images_and_server_errors(triton):
    images = generate("two of them", url=triton.grpc_url, steps=2, height=32, width=32, num_images=2, seed=1)
    assert [image.size for image in images] == [(32, 32), (32, 32)]
    for protocol, url in (("grpc", triton.grpc_url), ("http", triton.http_url)):
        with pytest.raises(ServerError, match=r"INVALID_ARG: input 'height'"):
            generate("too big", url=url, protocol=protocol, height=4097)


@pytest.mark.parametrize("protocol_args", [[], ["--http"]], ids=["grpc", "http"])
def test_ctrl_c_cancels_the_request_on_the_server(triton, protocol_args, tmp_path):
    """The engine is held after the first step (the tick budget), so the request is running at Ctrl-C."""
    url = triton.http_url if protocol_args else triton.grpc_url
    cancelled_before = triton.log_text().count("qwen_image: cancelled request")
    triton.budget.allow(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "client", "generate", "--prompt", "long", "--size", "64", "--steps", "100",
         "--preview-every", "1", "--preview-dir", str(tmp_path), "--out", str(tmp_path / "never.png"),
         "--url", url, *protocol_args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        first = proc.stderr.readline()
        assert "step 1/100" in first, first + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        triton.budget.release()
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1] == "cancelled" and "Traceback" not in stderr and stdout == ""
    assert not (tmp_path / "never.png").exists()
    deadline = time.monotonic() + 10
    while triton.log_text().count("qwen_image: cancelled request") == cancelled_before:
        assert time.monotonic() < deadline, "the server never logged the cancel:\n" + triton.log_tail(20)
        time.sleep(0.1)


# -- video responses (decoding and saving; served videos: tests/serving/test_other_pipelines.py) ---------
def test_video_chunks_and_the_final_video_decode_with_their_sound(tmp_path):
    import wave

    from client.__main__ import save_video

    frames = np.zeros((1, 5, 4, 6, 3), np.uint8)
    chunk = decode_response({"step": [2], "num_steps": [4], "is_final": [False], "video": frames[:, :3],
                             "frame_offset": [0], "frame_rate": [24.0]}, is_last=False)
    assert isinstance(chunk, Progress) and chunk.chunk.frame_offset == 0 and chunk.chunk.frames.shape[1] == 3
    audio = np.linspace(-1, 1, 2 * 800, dtype=np.float32).reshape(1, 2, 800)
    final = decode_response({"step": [4], "num_steps": [4], "is_final": [True], "video": frames,
                             "video_mp4": [base64.b64encode(b"mp4 bytes")], "audio": audio,
                             "audio_sample_rate": [16000]}, is_last=True)
    assert isinstance(final, Final) and final.images == [] and final.video.mp4 == [b"mp4 bytes"]
    assert save_video(tmp_path / "v.npy", final.video) == [tmp_path / "v.npy"]
    assert np.load(tmp_path / "v.npy").shape == (1, 5, 4, 6, 3)
    save_video(tmp_path / "v.mp4", final.video)
    assert (tmp_path / "v.mp4").read_bytes() == b"mp4 bytes"
    save_video(tmp_path / "v.wav", final.video)
    with wave.open(str(tmp_path / "v.wav")) as wav:
        assert (wav.getnchannels(), wav.getframerate(), wav.getnframes()) == (2, 16000, 800)
    with pytest.raises(ResponseFormatError, match="no audio"):
        save_video(tmp_path / "x.wav", decode_response({"is_final": [True], "video": frames}, is_last=True).video)
