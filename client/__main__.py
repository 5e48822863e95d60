"""Command line: `python -m client generate --prompt "..." --out out.png`.

Streams one request, draws a progress bar from the step responses, saves
previews when asked and every final image, and prints one result line.
Ctrl-C cancels the request on the server and exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from client.api import DEFAULT_TIMEOUT_S, stream
from client.events import ClientError, Final, Progress
from client.progress import ProgressBar

EXIT_ERROR = 1
EXIT_CANCELLED = 130  # the shell's code for "terminated by SIGINT"


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate images for a prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt")
    gen.add_argument("--steps", type=_positive, help="num_inference_steps")
    gen.add_argument("--size", type=_positive, help="height and width in pixels")
    gen.add_argument("--height", type=_positive)
    gen.add_argument("--width", type=_positive)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--cfg", type=float, dest="true_cfg_scale", help="true_cfg_scale")
    gen.add_argument("--guidance-scale", type=float)
    gen.add_argument("--num-images", type=_positive)
    gen.add_argument("--preview-every", type=_non_negative, default=1,
                     help="a progress response with a preview every K steps (default 1; 0: final image only)")
    gen.add_argument("--preview-dir", type=Path, help="save the previews here")
    gen.add_argument("--out", type=Path, default=Path("out.png"),
                     help="output PNG; several images become out-0.png, out-1.png, ...")
    gen.add_argument("--http", action="store_true", help="use HTTP generate_stream instead of gRPC")
    gen.add_argument("--url", help="host:port (default localhost:8001 gRPC, localhost:8000 HTTP)")
    gen.add_argument("--model", default="qwen_image")
    gen.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.size is not None:
        if args.height is not None or args.width is not None:
            parser.error("--size cannot be combined with --height/--width")
        args.height = args.width = args.size
    return args


def output_paths(out: Path, count: int) -> List[Path]:
    """`out` for one image; out-0.png, out-1.png, ... for several."""
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i}{out.suffix or '.png'}") for i in range(count)]


def _save_previews(directory: Path, event: Progress) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for path, image in zip(output_paths(directory / f"step-{event.step:04d}.png", len(event.previews)),
                           event.previews):
        image.save(path)


def run_generate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    bar = ProgressBar()
    events = stream(
        args.prompt,
        url=args.url,
        protocol="http" if args.http else "grpc",
        model=args.model,
        timeout=args.timeout,
        steps=args.steps,
        height=args.height,
        width=args.width,
        seed=args.seed,
        negative_prompt=args.negative_prompt,
        true_cfg_scale=args.true_cfg_scale,
        guidance_scale=args.guidance_scale,
        num_images=args.num_images,
        preview_interval=args.preview_every or 0,
    )
    final = None
    # closing() cancels the request if we leave early (Ctrl-C while saving a preview).
    with contextlib.closing(events), contextlib.closing(bar):
        for event in events:
            if isinstance(event, Progress):
                bar.update(event.step, event.num_steps)
                if event.previews and args.preview_dir is not None:
                    _save_previews(args.preview_dir, event)
            elif isinstance(event, Final):
                final = event
                if bar.shown and final.num_steps:
                    bar.update(final.num_steps, final.num_steps)
    assert final is not None, "stream() ends with a Final or raises"
    paths = output_paths(args.out, len(final.images))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for path, image in zip(paths, final.images):
        image.save(path)
    width, height = final.images[0].size
    names = ", ".join(str(p) for p in paths)
    print(f"saved {names} ({width}x{height}) in {time.monotonic() - started:.2f} s", flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        return run_generate(args)
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr, flush=True)
        return EXIT_CANCELLED
    except (ClientError, OSError) as exc:  # OSError: an output path we cannot write
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
