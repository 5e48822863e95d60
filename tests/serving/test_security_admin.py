"""Triton's admin APIs behind the launcher's admin key (docs/serving.md, Admin APIs and Triton's advisories).

Through the session's `secured` launcher (tests/helpers/launched.py): every admin-like protocol is refused
without TRITON_ADMIN_KEY on HTTP and on gRPC and answers with it, a Python stub's own shared-memory region
cannot be registered and written by an inference output, and the key is on no command line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from engine_lib.serving.processes import proc_stat
from engine_lib.serving.tritonserver import ADMIN_HEADER
from tests.helpers.launched import ADMIN_KEY, MODEL
from tests.helpers.streaming import RequestStream, make_inputs, run_request

# tritonserver 2.51 expects a restricted gRPC protocol's header with this prefix (its error says so).
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
HEADERS = {"http": {ADMIN_HEADER: ADMIN_KEY}, "grpc": {GRPC_ADMIN_HEADER: ADMIN_KEY}}
REGION = "/admin-probe-none"  # a shared-memory key that does not exist

# (protocol, call): harmless reads, tried with the key and without it.
READS = [
    ("shared-memory", lambda c, h: c.get_system_shared_memory_status(headers=h)),
    ("shared-memory", lambda c, h: c.get_cuda_shared_memory_status(headers=h)),
    ("model-repository", lambda c, h: c.get_model_repository_index(headers=h)),
    ("statistics", lambda c, h: c.get_inference_statistics(headers=h)),
    ("trace", lambda c, h: c.get_trace_settings(headers=h)),
    ("logging", lambda c, h: c.get_log_settings(headers=h)),
]
# Changes, tried without the key only.
WRITES = [
    ("shared-memory", lambda c, h: c.register_system_shared_memory("probe", REGION, 64, headers=h)),
    ("shared-memory", lambda c, h: c.unregister_system_shared_memory(headers=h)),
    ("shared-memory", lambda c, h: c.unregister_cuda_shared_memory(headers=h)),
    ("model-repository", lambda c, h: c.load_model(MODEL, headers=h)),
    ("model-repository", lambda c, h: c.unload_model(MODEL, headers=h)),
    ("trace", lambda c, h: c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}, headers=h)),
    ("logging", lambda c, h: c.update_log_settings({"log_verbose_level": 1}, headers=h)),
]


@pytest.fixture(scope="module")
def clients(secured):
    """One HTTP and one gRPC client of the secured launcher's tritonserver (gRPC: whatever its port serves)."""
    made = {"http": httpclient.InferenceServerClient(f"127.0.0.1:{secured.http}"),
            "grpc": grpcclient.InferenceServerClient(secured.grpc_url)}
    yield made
    for client in made.values():
        client.close()


def _ids(calls):
    return [f"{protocol}-{call.__code__.co_names[0]}" for protocol, call in calls]


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("protocol, call", READS + WRITES, ids=_ids(READS + WRITES))
def test_an_admin_protocol_is_refused_without_the_key(clients, transport, protocol, call):
    for headers in (None, {ADMIN_HEADER: "wrong"}, {GRPC_ADMIN_HEADER: "wrong"}):
        with pytest.raises(InferenceServerException) as refused:
            call(clients[transport], headers)
        assert "restricted" in str(refused.value), (protocol, str(refused.value))
    assert clients[transport].is_model_ready(MODEL)  # the refused unload unloaded nothing


@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("protocol, call", READS, ids=_ids(READS))
def test_an_admin_protocol_answers_with_the_key(clients, transport, protocol, call):
    call(clients[transport], HEADERS[transport])


def test_a_stub_s_shared_memory_cannot_be_made_an_output_buffer(secured, clients):
    """The attack: register a stub's own region (its name is in ps and /dev/shm) and point an inference
    output at it, which overwrote the stub's allocator (the stub died, every model restarted)."""
    pid, region = secured.stub()
    size = Path("/dev/shm", region).stat().st_size
    for transport, client in clients.items():
        with pytest.raises(InferenceServerException, match="restricted"):
            client.register_system_shared_memory("stolen", "/" + region.lstrip("/"), size)
    stream = RequestStream(secured.grpc_url)
    try:
        output = grpcclient.InferRequestedOutput("image")
        output.set_shared_memory("stolen", size)
        stream.client.async_stream_infer(MODEL, make_inputs(prompt="steal", num_inference_steps=2, height=32,
                                                            width=32), outputs=[output], request_id="steal",
                                         enable_empty_final_response=True)
        refused = stream.collect(60)
    finally:
        stream.close()
    assert refused.errors and "stolen" in str(refused.error), refused.responses
    assert secured.stub()[0] == pid
    result = run_request(secured.grpc_url, prompt="after", num_inference_steps=2, height=32, width=32)
    assert result.num_final == 1 and not result.errors
    assert secured.stub()[0] == pid


def _descendants(root: int) -> list[int]:
    """`root` and every process below it (by parent pid)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(proc_stat(stat.parent.name)[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def test_the_admin_key_is_on_no_command_line(secured):
    pids = _descendants(secured.process.pid)
    names = {}
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        names[pid] = argv.split(b"\0")[0].rsplit(b"/", 1)[-1].decode()
        assert ADMIN_KEY.encode() not in argv, (pid, argv.replace(b"\0", b" ")[:200])
    assert "tritonserver" in names.values() and "triton_python_backend_stub" in names.values(), names


def test_the_stubs_shared_memory_is_readable_by_its_owner_only(secured):
    """tritonserver creates the regions 0644: every user of the host could read prompts and images in flight."""
    regions = secured.shm_regions()
    assert regions
    for name in regions:
        assert Path("/dev/shm", name).stat().st_mode & 0o777 == 0o600, name
