"""SIGKILL of a whole launcher tree serving LTX-2, then a new launcher on the same DIFFUSION_DATA_DIR: the
completed video job is listed and downloads the same bytes, the running one ends `failed`, "server restarted".

    .venv/bin/python scripts/job_restart_check.py        (about two minutes; the tiny LTX-2 of `make models`)

Prints one line per check and exits 1 if one fails. Not part of `make test`: two launcher starts take over a
minute here; the tests check the same on a killed front door (docs/serving.md, Where jobs and results are kept).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import openai

from engine_lib.serving.processes import REPO_ROOT, free_port

warnings.filterwarnings("ignore", "The Sora API")  # the SDK's own deprecation of videos


def launch(work: Path, tag: str, ports: list[int]) -> subprocess.Popen:
    env = {**os.environ, "MODELS": "ltx2", "DIFFUSION_DATA_DIR": str(work / "data"), "OPENAI_API_KEY": ""}
    return subprocess.Popen(
        [sys.executable, "-m", "engine_lib.serving.serve", "serve", f"--http-port={ports[0]}",
         f"--grpc-port={ports[1]}", f"--metrics-port={ports[2]}", f"--openai-port={ports[3]}",
         f"--log-file={work / f'triton-{tag}.log'}"],
        env=env, stdout=open(work / f"launcher-{tag}.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
        cwd=REPO_ROOT)


def serving(launcher: subprocess.Popen, ports: list[int], timeout_s: float = 600) -> openai.OpenAI:
    """The front door's client once tritonserver says ltx2 is ready and the front door answers."""
    client = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{ports[3]}/v1", max_retries=0, timeout=60)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            raise SystemExit(f"the launcher exited with {launcher.returncode}")
        if all(status(f"http://127.0.0.1:{port}{path}") == 200 for port, path in
               ((ports[0], "/v2/models/ltx2/ready"), (ports[3], "/health"))):
            return client
        time.sleep(0.5)
    raise SystemExit(f"not serving within {timeout_s:.0f} s")


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status
    except (urllib.error.URLError, OSError):
        return 0


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="job-restart-"))
    ports = [free_port() for _ in range(4)]
    start = time.monotonic()
    first = launch(work, "a", ports)
    client = serving(first, ports)
    print(f"serving {time.monotonic() - start:.0f} s after the start")
    done = client.videos.poll(client.videos.create(model="ltx2", prompt="a waterfall", size="64x32", seconds="1",
                                                   extra_body={"frame_rate": 8, "num_inference_steps": 2}).id,
                              poll_interval_ms=100)
    mp4 = client.videos.download_content(done.id).content
    running = client.videos.create(model="ltx2", prompt="a long river", size="64x64", seconds="4",
                                   extra_body={"num_inference_steps": 50})
    os.killpg(first.pid, signal.SIGKILL)  # the launcher's group; its servers' reapers take tritonserver's
    first.wait()
    killed = time.monotonic()
    second = launch(work, "b", ports)
    try:
        client = serving(second, ports)
        print(f"serving again {time.monotonic() - killed:.0f} s after the SIGKILL")
        checks = {
            "both jobs listed": [v.id for v in client.videos.list(order="asc")] == [done.id, running.id],
            "the completed job retrieved": client.videos.retrieve(done.id).status == "completed",
            "its download has the same bytes": client.videos.download_content(done.id).content == mp4,
        }
        after = client.videos.retrieve(running.id)
        checks[f"the running job ended {after.status} ({after.error and after.error.message}) "
               f"{time.monotonic() - killed:.0f} s after the SIGKILL"] = (
            after.status == "failed" and after.error.message == "server restarted")
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(180)
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
