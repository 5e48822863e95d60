"""The gRPC gate's per-stream bookkeeping (grpc_gate.GateStream), without a server: what a slow reader is
sent, which requests are open, and how a stop ends them (served: tests/serving/test_grpc_streams.py)."""

from __future__ import annotations

import asyncio

from tritonclient.grpc import service_pb2

from engine_lib.serving.grpc_gate import SHUTTING_DOWN, GateStream


def _request(request_id: str) -> bytes:
    return service_pb2.ModelInferRequest(model_name="qwen_image", id=request_id).SerializeToString()


def _response(request_id: str, final: bool, size: int = 1000, error: str = "") -> bytes:
    response = service_pb2.ModelStreamInferResponse(error_message=error)
    response.infer_response.id = request_id
    response.infer_response.raw_output_contents.append(b"x" * size)
    response.infer_response.parameters["triton_final_response"].bool_param = final
    return response.SerializeToString()


async def _items(iterator) -> list:
    return [item async for item in iterator]


async def _forward(stream: GateStream, *request_ids: str) -> list[bytes]:
    async def requests():
        for request_id in request_ids:
            yield _request(request_id)

    return await _items(stream.forwarded(requests()))


def _decoded(raw: bytes) -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse.FromString(raw)


def test_a_slow_readers_intermediate_responses_are_dropped_over_the_bound_and_finals_kept():
    stream = GateStream(max_unsent=2500)
    asyncio.run(_forward(stream, "a"))
    assert stream.open == {"a": 1}
    for _ in range(10):  # nothing is read meanwhile
        stream.receive(_response("a", final=False))
    stream.receive(_response("a", final=False, error="INTERNAL: not final"))  # an error always stays
    stream.receive(_response("a", final=True, size=100_000))  # over the bound alone: kept
    assert stream.dropped == 8 and len(stream.queue) == 4 and stream.open == {}
    assert stream.unsent == sum(map(len, stream.queue))
    big = GateStream(max_unsent=10)
    big.receive(_response("b", final=False))  # larger than the bound, nothing else unsent: kept
    assert len(big.queue) == 1 and big.dropped == 0
    once = GateStream(max_unsent=10)  # a model that is not decoupled: one response, no final flag
    asyncio.run(_forward(once, "c"))
    once.receive(service_pb2.ModelStreamInferResponse(infer_response={"id": "c"}).SerializeToString())
    assert once.open == {} and len(once.queue) == 1
    once.receive(b"\xff not a response")  # passed on as it came
    assert once.queue[-1] == b"\xff not a response"


def test_a_stop_ends_idle_streams_at_once_and_open_requests_with_one_final_each():
    async def scenario():
        idle, busy = GateStream(1 << 20), GateStream(1 << 20)
        await _forward(idle, "done")
        idle.receive(_response("done", final=True))
        await _forward(busy, "r1", "r1", "r2")  # ids need not be unique
        busy.receive(_response("r1", final=True))
        idle.close()
        busy.close()
        sent_idle = await asyncio.wait_for(_items(idle.responses()), 1)  # its final, then the end
        refused = await _forward(busy, "late")  # sent during the drain: answered by the gate, not forwarded
        busy.end_open_requests(SHUTTING_DOWN)
        busy.receive(_response("r2", final=True))  # too late: the gate made its final
        return sent_idle, refused, await asyncio.wait_for(_items(busy.responses()), 1)

    sent_idle, refused, sent_busy = asyncio.run(scenario())
    assert [_decoded(raw).infer_response.id for raw in sent_idle] == ["done"]
    assert refused == []
    finals = [_decoded(raw) for raw in sent_busy[1:]]
    assert sorted(f.infer_response.id for f in finals) == ["late", "r1", "r2"]
    for final in finals:
        assert final.error_message == f"UNAVAILABLE: [request id: {final.infer_response.id}] server shutting down"
        assert final.infer_response.parameters["triton_final_response"].bool_param


def test_bookkeeping_edges_duplicate_ids_untracked_finals_and_bytes_being_written():
    async def scenario():
        # Two open requests that share an id get a final each at the drain, not one for the id.
        twins = GateStream(1 << 20)
        await _forward(twins, "twin", "twin", "other")
        twins.receive(_response("other", final=True))
        twins.close()
        twins.end_open_requests(SHUTTING_DOWN)
        drained = [_decoded(raw).infer_response.id for raw in await asyncio.wait_for(_items(twins.responses()), 1)]
        # A final for an id the stream never forwarded (or forwarded fewer times) leaves nothing open behind.
        ghost = GateStream(1 << 20)
        await _forward(ghost, "real")
        for request_id in ("ghost", "real", "real"):
            ghost.receive(_response(request_id, final=True))
        still_open = dict(ghost.open)
        ghost.close()
        ghost_sent = await asyncio.wait_for(_items(ghost.responses()), 1)  # ends: nothing is open
        # A response is unsent until its write is done: while the client takes the first, it still counts.
        slow = GateStream(max_unsent=2500)
        await _forward(slow, "s")
        slow.receive(_response("s", final=False))
        slow.receive(_response("s", final=False))
        writer = slow.responses()
        await writer.__anext__()  # handed to the client, its write not yet done
        slow.receive(_response("s", final=False))  # 3 x ~1 kB unsent would pass the bound: dropped
        being_written = (slow.unsent, slow.dropped)
        await writer.__anext__()  # the first written, the second being written
        return drained, still_open, len(ghost_sent), being_written, slow.unsent

    drained, still_open, ghost_sent, being_written, unsent = asyncio.run(scenario())
    assert drained == ["other", "twin", "twin"]
    assert still_open == {} and ghost_sent == 3
    one = len(_response("s", final=False))
    assert being_written == (2 * one, 1) and unsent == one


def test_done_writing_ends_the_forwarded_requests_while_the_client_sends_nothing():
    """A stream whose requests all have their finals is half-closed upstream (done_writing), not cancelled: its
    forwarded requests end although the client neither sends nor half-closes."""
    async def scenario():
        stream = GateStream(1 << 20)
        client_done = asyncio.Event()

        async def requests():
            yield _request("a")
            await client_done.wait()  # a client that holds its stream open

        forwarded = asyncio.ensure_future(_items(stream.forwarded(requests())))
        await asyncio.sleep(0.05)
        stream.receive(_response("a", final=True))
        stream.done_writing.set()
        sent = await asyncio.wait_for(forwarded, 1)
        return sent, dict(stream.open)

    sent, still_open = asyncio.run(scenario())
    assert [service_pb2.ModelInferRequest.FromString(raw).id for raw in sent] == ["a"] and still_open == {}
