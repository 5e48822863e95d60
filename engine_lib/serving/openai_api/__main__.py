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
    args = parser.parse_args(argv)
    import uvicorn

    from engine_lib.serving.openai_api.app import create_app
    from engine_lib.serving.openai_api.keys import FrontDoorKeys

    try:
        keys = FrontDoorKeys.from_env(os.environ)
    except ValueError as exc:  # names the entry, never the key
        print(f"openai front door: {exc}", file=sys.stderr)
        return 2
    app = create_app(args.triton, keys)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
