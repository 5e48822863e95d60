"""`make demo`: start tritonserver on the model repository, generate one image with the client, stop.

Ports come from HTTP_PORT / GRPC_PORT / METRICS_PORT (defaults 8000-8002); the
image goes to $DEMO_OUT (default out/demo.png).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from engine_lib.serving.launcher import TritonServer, TritonServerError

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    out = Path(os.environ.get("DEMO_OUT", ROOT / "out" / "demo.png")).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    server = TritonServer(log_path=ROOT / "out" / "demo-tritonserver.log")
    print(f"demo: starting tritonserver (grpc {server.grpc_url}), log in {server.log_path}", flush=True)
    try:
        server.start()
    except TritonServerError as exc:
        print(f"demo: the server did not start: {exc}", file=sys.stderr)
        return 1
    try:
        command = [sys.executable, "-m", "client", "generate", "--url", server.grpc_url,
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
