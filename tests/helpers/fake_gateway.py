"""A stand-in for the front door's TritonGateway in in-process tests (FastAPI's TestClient): one ready
model `m`, no Triton. Subclasses say what `m` declares (`_config`) and how it answers (`stream`).
HOSTILE_VALUES: malformed JSON values those tests put in every field."""

from __future__ import annotations

from engine_lib.serving.openai_api.gateway import TritonGateway

HOSTILE_VALUES = ["null", "true", "-0", "2147483648", "1" + "0" * 400, "1e400", "NaN", "-Infinity", '""', '"\\u0000"',
                  '"64x64\\n"', "[]", "{}", "[[1]]", '{"a": [1]}', "[" * 900 + "]" * 900, '{"a":' * 900 + "1" + "}" * 900]


class OneModelGateway(TritonGateway):
    def __init__(self, url: str):
        import tritonclient.grpc.aio as grpcclient  # noqa: PLC0415 (the app's own import, for its tensor types)

        self._grpc, self.url, self._configs = grpcclient, url, {}

    async def close(self) -> None:
        pass

    async def server_ready(self) -> bool:
        return True

    async def ready_models(self) -> list[str]:
        return ["m"]
