"""Minimal server-sent-events reader for Triton's `generate_stream`.

Triton sends each response as one `data: <json>` event followed by a blank
line; this yields the data of each event (multi-line data joined with \n).
"""

from __future__ import annotations

from typing import Iterable, Iterator, List, Union


def iter_sse_data(lines: Iterable[Union[bytes, str]]) -> Iterator[str]:
    """Yield the `data` payload of each event in a stream of lines."""
    data: List[str] = []
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):  # comment / keep-alive
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:  # stream closed without the trailing blank line
        yield "\n".join(data)
