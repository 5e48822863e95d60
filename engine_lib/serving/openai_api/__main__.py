"""`python -m engine_lib.serving.openai_api`: serve the OpenAI Images API in front of a tritonserver."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_lib.serving.openai_api", description=__doc__)
    parser.add_argument("--triton", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT") or 9000))
    parser.add_argument("--drain-s", type=float, default=5.0,
                        help="on SIGTERM, how long running requests may still take (the launcher passes the gate's drain)")
    args = parser.parse_args(argv)
    import uvicorn

    from engine_lib.serving.openai_api.app import create_app
    from engine_lib.serving.openai_api.http_limits import DRAIN_MARGIN_S, KEEP_ALIVE_S, HeaderTimeoutProtocol
    from engine_lib.serving.openai_api.keys import FrontDoorKeys
    from engine_lib.serving.openai_api.store import open_store

    try:
        keys = FrontDoorKeys.from_env(os.environ)
    except ValueError as exc:  # names the entry, never the key
        print(f"openai front door: {exc}", file=sys.stderr)
        return 2
    try:
        store = open_store(os.environ)
    except Exception as exc:  # noqa: BLE001 - a bad setting or a database it cannot reach: one line, no traceback
        print(f"openai front door: the job store cannot open: {type(exc).__name__}: {exc}".strip(), file=sys.stderr)
        return 2
    app = create_app(args.triton, keys, store)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", http=HeaderTimeoutProtocol,
                timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=args.drain_s + DRAIN_MARGIN_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
