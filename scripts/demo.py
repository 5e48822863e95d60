"""`make demo`: start tritonserver on the model repository, generate one image with the client, stop.

The server loads only the models MODELS names (default qwen_image; names of
model_repository/ separated by commas, or `all`), so it is ready in seconds. The
image comes from qwen_image when it is loaded, else from the first model named (a
video model writes an mp4 instead). Ports come from HTTP_PORT / GRPC_PORT /
METRICS_PORT (defaults 8000-8002); the output goes to $DEMO_OUT (default
out/demo.png, or out/demo.mp4 for a video model).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

from engine_lib.serving.processes import TritonServerError
from engine_lib.serving.serve import DEFAULT_MODELS, MODELS_ENV, repository_models, select_models
from engine_lib.serving.tritonserver import TritonServer

ROOT = Path(__file__).resolve().parent.parent


def is_video_model(config: Path) -> bool:
    """The model's config.pbtxt declares a `video` output."""
    return re.search(r'name:\s*"video"', config.read_text()) is not None


def main() -> int:
    server = TritonServer(log_path=ROOT / "out" / "demo-tritonserver.log", admin_key=secrets.token_urlsafe(24))
    try:
        server.load_models = select_models(os.environ.get(MODELS_ENV), server.model_repository)
    except TritonServerError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    chosen = repository_models(server.model_repository) if server.load_models == ["*"] else server.load_models
    model = DEFAULT_MODELS[0] if DEFAULT_MODELS[0] in chosen else chosen[0] if chosen else DEFAULT_MODELS[0]
    video = is_video_model(server.model_repository / model / "config.pbtxt")
    out = Path(os.environ.get("DEMO_OUT", ROOT / "out" / ("demo.mp4" if video else "demo.png"))).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"demo: starting tritonserver (grpc {server.grpc_url}; loading {', '.join(chosen)}), "
          f"log in {server.log_path}", flush=True)
    start = time.monotonic()
    try:
        server.start()
    except TritonServerError as exc:
        print(f"demo: the server did not start: {exc}", file=sys.stderr)
        return 1
    print(f"demo: tritonserver ready in {time.monotonic() - start:.1f} s", flush=True)
    try:
        command = [sys.executable, "-m", "client", "generate", "--url", server.grpc_url, "--model", model,
                   "--prompt", "a red cube on a blue floor", "--steps", "8", "--size", "64", "--seed", "1",
                   "--out", str(out)]
        print("demo: " + " ".join(command[1:]), flush=True)
        code = subprocess.call(command, cwd=ROOT)
    finally:
        start = time.monotonic()
        server.stop()
        server.cleanup()
        print(f"demo: server stopped in {time.monotonic() - start:.1f}s", flush=True)
    if code != 0:
        print(f"demo: the client failed (exit {code})", file=sys.stderr)
        return code
    print(f"demo: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
