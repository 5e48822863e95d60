"""Shared fixtures for the whole test suite."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers.early_servers import serve_early, start_marked, starts_early, stop_untaken
from tests.helpers.waiting import TickBudget

# One torch thread per process: the tests run pytest and tritonserver's stub side by
# side on 2 cores, where 2 threads each oversubscribe the CPU (measured: a tiny Flux
# call 2.8 s with 2 threads under load, 0.05 s with 1). Set before torch is imported;
# servers started by the tests inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The front doors the tests start (in-process and as servers' children) keep their jobs and stored images in a
# data dir of the session's own, not in the repository's `data/`.
if "DIFFUSION_DATA_DIR" not in os.environ:
    os.environ["DIFFUSION_DATA_DIR"] = tempfile.mkdtemp(prefix="diffusion-test-data-")
    atexit.register(shutil.rmtree, os.environ["DIFFUSION_DATA_DIR"], True)


@pytest.fixture(scope="session")
def tiny_qwen_dir() -> Path:
    """The tiny random-weight Qwen-Image pipeline, saved under models/ (built once if missing)."""
    from engine_lib.pipelines.tiny_models import ensure_model

    return ensure_model("qwen_image", "tiny")


def pytest_collection_finish(session):
    start_marked(session)  # tests/helpers/early_servers.py


def pytest_sessionfinish(session):
    stop_untaken()


def _start_shared_server(tmp_path_factory):
    """The session's `server`, not waiting until it is ready."""
    from tests.helpers.servers import FAIL_PROMPT, NAN_PROMPT, default_model_path, start_server

    return start_server(tmp_path_factory.mktemp("server"), default_model_path(), fail_prompt=FAIL_PROMPT,
                        nan_prompt=NAN_PROMPT, wait=False)


@pytest.fixture(scope="session")
@starts_early(_start_shared_server)
def server(tmp_path_factory):
    """The shipped qwen_image configuration on the tiny model behind a real tritonserver, shared by the session's
    served tests (tests/serving, tests/client), started early (tests/helpers/early_servers.py)."""
    yield from serve_early(_start_shared_server, tmp_path_factory)


@pytest.fixture
def tick_budget(tmp_path):
    budget = TickBudget(tmp_path / "tick_budget")
    yield budget
    budget.release()
