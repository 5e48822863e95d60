"""Static checks of the GPU deployment files (no Docker engine needed).

They pin what a GPU host needs and is easy to lose in an edit: the GPU
reservation, shared memory for the Python backend, the ports, a readiness
healthcheck, a drain-friendly stop, weights from DIFFUSION_MODEL_PATH, and a
pinned Triton base image that installs requirements.txt.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def _size_bytes(text) -> int:
    """Compose byte sizes: an int, or '8gb', '512m', ..."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(text).strip().lower())
    assert match, f"unparsable size {text!r}"
    return int(match.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2)]


def _seconds(text) -> float:
    """Compose durations such as '150s', '2m30s', '30m'."""
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(text)):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    assert total > 0, f"unparsable duration {text!r}"
    return total


@pytest.fixture(scope="module")
def service() -> dict:
    compose = yaml.safe_load(COMPOSE.read_text())
    assert "tritonserver" in compose["services"], "docker-compose.yml needs a 'tritonserver' service"
    return compose["services"]["tritonserver"]


def _volumes(service: dict) -> dict:
    """Mount target -> host source for the short syntax `source:target[:mode]` (source may hold ${X:-y})."""
    mounts = {}
    for volume in service["volumes"]:
        spec = re.sub(r":(ro|rw)$", "", volume)
        source, _, target = spec.rpartition(":")
        mounts[target] = source
    return mounts


def _command(service: dict) -> list:
    command = service["command"]
    return command.split() if isinstance(command, str) else list(command)


def test_built_from_the_project_dockerfile(service):
    build = service["build"]
    assert (ROOT / build.get("context", ".") / build["dockerfile"]).resolve() == DOCKERFILE.resolve()


def test_runs_the_supervising_launcher_on_the_mounted_model_repository(service):
    command = _command(service)
    assert command[:4] == ["python3", "-m", "engine_lib.serving.serve", "serve"]
    repo_args = [a.split("=", 1)[1] for a in command if a.startswith("--model-repository=")]
    assert repo_args, "tritonserver needs --model-repository"
    mounts = _volumes(service)
    assert repo_args[0] in mounts, f"{repo_args[0]} is not a mounted volume"
    assert mounts[repo_args[0]].rstrip("/") == "./model_repository"


def test_python_backend_shared_memory_fits_in_shm_size(service):
    from engine_lib.serving.tritonserver import DEFAULT_SHM_BYTES, TritonServer

    command = TritonServer(Path("/models")).command(Path("/backends"))
    assert f"--backend-config=python,shm-default-byte-size={DEFAULT_SHM_BYTES}" in command
    shm_default = DEFAULT_SHM_BYTES
    assert shm_default >= 16 << 20, "a few 1024x1024 images need more than 16 MiB"
    assert _size_bytes(service["shm_size"]) >= 4 * shm_default, "shm_size must hold several stub regions"


def test_weights_and_hf_cache(service):
    env = service["environment"]
    for pipeline in ("QWEN_IMAGE", "FLUX", "SD3"):
        name = f"DIFFUSION_MODEL_PATH_{pipeline}"
        assert env.get(name), f"point {name} at weights"
    hf_home = env["HF_HOME"]
    assert hf_home in _volumes(service), "HF_HOME must be a mounted folder so downloads survive restarts"


def test_loads_only_the_chosen_model(service):
    """Every model loads at start in the default mode; with weights for one pipeline the others would fail."""
    assert any(a.startswith("--load-model=") for a in _command(service))


def test_the_default_model_is_the_launchers(service):
    """Compose, the Dockerfile's CMD and `make serve` load the same model unless told otherwise."""
    from engine_lib.serving.serve import DEFAULT_MODELS, select_models
    from engine_lib.serving.tritonserver import DEFAULT_MODEL_REPOSITORY

    [load] = [a for a in _command(service) if a.startswith("--load-model=")]
    default = re.fullmatch(r"--load-model=\$\{TRITON_LOAD_MODEL:-([^}]+)\}", load)
    assert default, f"{load!r}: TRITON_LOAD_MODEL picks the model, with a default"
    assert select_models(default.group(1), DEFAULT_MODEL_REPOSITORY) == list(DEFAULT_MODELS)
    assert f'"--load-model={",".join(DEFAULT_MODELS)}"' in DOCKERFILE.read_text()


def test_reserves_an_nvidia_gpu(service):
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def _published(service: dict) -> dict[str, str]:
    """Container port -> the host address it is published on ('' for every interface), from the short
    syntax `[host_ip:][host_port:]container_port`."""
    published = {}
    for spec in service["ports"]:
        parts = str(spec).split(":")
        published[parts[-1]] = parts[0] if len(parts) == 3 else ""
    return published


def test_publishes_only_what_one_request_cannot_crash(service):
    """gRPC (through the gate) and the front door; metrics on the host's loopback; never tritonserver's HTTP
    port, which a nested JSON body crashes (docs/serving.md, Security)."""
    published = _published(service)
    assert set(published) == {"8001", "8002", "9000"}, published
    assert published["8002"] == "127.0.0.1", "the metrics have no authentication: keep them on the host"
    environment = service["environment"]
    assert environment.get("TRITON_HTTP_ADDRESS", "127.0.0.1") == "127.0.0.1"
    assert int(environment.get("GRPC_MAX_MESSAGE_BYTES", 1)) > 0, "0 would publish tritonserver's own gRPC port"


def test_healthcheck_asks_for_readiness(service):
    check = service["healthcheck"]
    assert check["test"] == ["CMD", "python3", "-m", "engine_lib.serving.serve", "ready"], \
        "every public port serves, not only tritonserver's (tests/serving/test_supervision.py)"
    assert _seconds(check["start_period"]) >= 300, "weights take minutes to load; do not mark unhealthy early"


def test_stop_grace_period_covers_the_drain(service):
    drain_s = int(service["environment"].get("EXIT_TIMEOUT_SECS", 30))  # the launcher's default
    assert _seconds(service["stop_grace_period"]) > drain_s, "SIGKILL must not come before the drain ends"


def test_listening_on_every_interface_is_an_explicit_opt_in(service):
    from engine_lib.serving.processes import DEFAULT_ADDRESS

    assert DEFAULT_ADDRESS == "127.0.0.1", "the launcher alone exposes nothing"
    assert service["environment"]["TRITON_ADDRESS"] == "0.0.0.0"
    dockerfile = DOCKERFILE.read_text()
    assert "TRITON_ADDRESS=0.0.0.0" in dockerfile and "TRITONSERVER=/opt/tritonserver/bin/tritonserver" in dockerfile
    [exposed] = re.findall(r"^EXPOSE\s+(.*)$", dockerfile, re.M)
    assert exposed.split() == ["8001", "9000"], "docker run -P publishes what is exposed, on every interface"


def test_dockerfile_base_image_is_a_pinned_triton_tag():
    from_lines = [line.split() for line in DOCKERFILE.read_text().splitlines() if line.upper().startswith("FROM ")]
    assert from_lines, "Dockerfile has no FROM"
    image = from_lines[0][1]
    match = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d{2}\.\d{2})-py3", image)
    assert match, f"base image {image!r} is not a pinned nvcr.io tritonserver -py3 tag"
    assert "latest" not in image


def test_dockerfile_installs_requirements_txt_and_the_project():
    text = DOCKERFILE.read_text()
    assert re.search(r"^COPY\s+requirements\.txt\b", text, re.M), "copy requirements.txt (the one place for pins)"
    assert re.search(r"pip install[^\n]*-r\s+\S*requirements", text), "install the pinned requirements"
    assert re.search(r"pip install[^\n]*\s\.\s*$", text, re.M), "install the project itself"
    # every path the image copies must exist in the repository
    for src in re.findall(r"^COPY\s+(\S+)", text, re.M):
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"


def test_compose_mount_sources_are_relative_or_configurable(service):
    """Absolute host paths would tie the file to one machine."""
    for source in _volumes(service).values():
        assert source.startswith(("./", "${")), f"volume source {source!r} should be relative or an env var"


def test_the_front_door_runs_in_the_same_service():
    """The launcher starts it next to tritonserver (it needs the repository API's key)."""
    compose = yaml.safe_load(COMPOSE.read_text())
    assert set(compose["services"]) == {"tritonserver"}
    service = compose["services"]["tritonserver"]
    assert not any(a.startswith("--openai-port") for a in _command(service))  # default 9000
    assert any(str(p).split(":")[-1] == "9000" for p in service["ports"])


def test_the_front_doors_data_dir_is_a_mounted_folder(service):
    """Video jobs and stored results outlive the container only on a volume."""
    assert service["environment"]["DIFFUSION_DATA_DIR"] in _volumes(service)
