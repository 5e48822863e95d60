"""What an input image costs at admission, where a model decodes it before queueing the request:
`python -m benchmarks.admission_images [--served]` prints one line per measurement, then a JSON summary.

In-process: CPU seconds of `decode_image` for files at the limits and past them, and on a 1 x 16777216 PNG with the
side limit lifted (admission before there was one). With `--served`: SD3's tiny pipeline behind tritonserver, one
valid request's latency alone, beside six such tall PNGs (each refused) and beside six files of random bytes
(refused as no image: what six refusals cost anyway); the median and the least of interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import threading
import time
from unittest import mock

from PIL import Image

from engine_lib import images
from engine_lib.images import MAX_IMAGE_PIXELS, decode_image
from engine_lib.request import InvalidInputError

TALL = (1, MAX_IMAGE_PIXELS)  # inside the pixel limit, 16 million rows


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (40, 80, 120)).save(buffer, "PNG")
    return buffer.getvalue()


def cpu_seconds(function) -> tuple[float, str]:
    start = time.process_time()
    try:
        function()
        outcome = "accepted"
    except InvalidInputError as exc:
        outcome = f"refused ({str(exc)[:60]}...)"
    return time.process_time() - start, outcome


def in_process() -> dict:
    results = {}
    for width, height in ((4096, 4096), (8192, 2048), (2048, 8192), TALL, TALL[::-1]):
        data = png(width, height)
        seconds, outcome = cpu_seconds(lambda: decode_image(data))
        results[f"{width}x{height}"] = seconds
        print(f"decode_image {width}x{height} ({len(data)} bytes): {seconds:.4f} s CPU, {outcome}")
    data = png(*TALL)
    with mock.patch.object(images, "MAX_IMAGE_SIDE", MAX_IMAGE_PIXELS):  # the side limit lifted
        seconds, outcome = cpu_seconds(lambda: decode_image(data))
    results["tall_without_side_limit"] = seconds
    print(f"decode_image {TALL[0]}x{TALL[1]} without the side limit: {seconds:.4f} s CPU, {outcome}")
    return results


def served(rounds: int = 5) -> dict:
    from benchmarks.systems import System, engine, serve
    from client.api import generate
    from engine_lib.pipelines.tiny_models import ensure_model

    system = System("sd3", "SD3 tiny", pipeline="sd3", parameters=engine())
    valid = dict(model="sd3", height=64, width=64, steps=4, seed=1, guidance_scale=1.0)
    beside = {"alone": None, "six tall PNGs": png(*TALL), "six files of random bytes": bytes(range(256)) * 256}
    latencies: dict[str, list[float]] = {name: [] for name in beside}
    with serve(system, ensure_model("sd3", "tiny")) as running:
        url = running.target.url
        generate("warm", url=url, **valid)

        def refused(image: bytes) -> None:
            with contextlib.suppress(Exception):  # refused at admission, as expected
                generate("refused", url=url, image=image, **valid)

        for _ in range(rounds):  # interleaved, so that the machine's load drifts alike for each
            for name, image in beside.items():
                threads = [threading.Thread(target=refused, args=(image,)) for _ in range(6 if image else 0)]
                for thread in threads:
                    thread.start()
                start = time.monotonic()
                generate("valid", url=url, **valid)
                latencies[name].append(time.monotonic() - start)
                for thread in threads:
                    thread.join()
    for name, values in latencies.items():
        print(f"served valid request, {name}: median {statistics.median(values):.2f} s, least {min(values):.2f} s "
              f"of {rounds} ({', '.join(f'{v:.2f}' for v in values)})")
    return {name: {"median_s": statistics.median(values), "least_s": min(values)} for name, values in latencies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--served", action="store_true", help="also measure the served delay (starts tritonserver)")
    args = parser.parse_args()
    summary = {"cpu_seconds": in_process()}
    if args.served:
        summary["served"] = served()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
