"""A stand-in for the front door's TritonGateway in in-process tests (FastAPI's TestClient): one ready
model `m`, no Triton. Subclasses say what `m` declares (`_config`) and how it answers (`stream`)."""

from __future__ import annotations

from engine_lib.serving.openai_api.gateway import TritonGateway


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
