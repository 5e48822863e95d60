"""Real tritonserver fixtures: the repository's qwen_image model, copied to a tmp dir with
parameters adjusted per test module, served on free loopback ports.

`server` is shared by the whole session (the shipped configuration); modules that need
other parameters or that kill their server start their own with `start_server`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

import pytest

from engine_lib.serving.launcher import REPO_ROOT, TritonServer

MODEL_DIR = REPO_ROOT / "model_repository" / "qwen_image"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replace (or add) one `parameters` entry of a config.pbtxt."""
    entry = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}'
    pattern = re.compile(r'parameters:\s*\{\s*key:\s*"' + re.escape(key) + r'"[^\n]*\}\s*\}')
    if pattern.search(config_text):
        return pattern.sub(lambda _: entry, config_text)
    return config_text.rstrip("\n") + "\n" + entry + "\n"


def write_repository(root: Path, **parameters: str) -> Path:
    """A copy of the model repository holding qwen_image with `parameters` overridden."""
    target = root / "qwen_image"
    shutil.copytree(MODEL_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "config.pbtxt"
    text = config.read_text()
    for key, value in parameters.items():
        text = set_parameter(text, key, str(value))
    config.write_text(text)
    return root


def model_path(request) -> str:
    return os.environ.get("DIFFUSION_MODEL_PATH") or str(request.getfixturevalue("tiny_qwen_dir"))


def start_server(tmp_dir: Path, model_path: str, exit_timeout_s: int = 30, **parameters: str) -> TritonServer:
    repo = write_repository(tmp_dir / "repository", model_path=model_path, **parameters)
    server = TritonServer(
        repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), address="127.0.0.1",
        log_path=tmp_dir / "tritonserver.log", exit_timeout_s=exit_timeout_s,
    )
    return server.start(timeout_s=300)


@pytest.fixture(scope="session")
def server(tmp_path_factory, request):
    """The shipped qwen_image configuration on the tiny model, shared by the session."""
    srv = start_server(tmp_path_factory.mktemp("server"), model_path(request))
    yield srv
    srv.cleanup()
