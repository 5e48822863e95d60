"""Command line: `python -m client generate --prompt "..." --out out.png`.

Streams one request, draws a progress bar from the step responses, saves
previews when asked and every final image, and prints one result line.
Videos: `--model helios --frames 65 --out clip.mp4` (an mp4, with sound where the
model makes it), `--out clip.npy` (the raw uint8 frames [N, F, H, W, 3]) or
`--out clip.wav` (the sound); the bar names each chunk as it arrives. Text (BAGEL: `--output-modality text` for an
answer, `--think` for a thought first) is printed to stdout as it streams; a text answer saves no image.
Ctrl-C cancels the request on the server and exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import wave
from pathlib import Path
from typing import List, Optional, Sequence, Union

import numpy as np

from client.api import DEFAULT_TIMEOUT_S, stream
from client.events import ClientError, Final, Progress, ResponseFormatError, Video
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
    gen.add_argument("--image", type=Path, action="append",
                     help="start from this PNG, JPEG or WebP file: image-to-image (sd3), the image to edit "
                          "(flux_kontext, qwen_image_edit), or the video's first frame (ltx2); given more than once, "
                          "the images qwen_image_edit_plus edits together")
    gen.add_argument("--strength", type=float, help="with --image: how much of the schedule runs, in (0, 1]")
    gen.add_argument("--mask", type=Path, help="with --image: inpaint where this mask is white, keep where it is "
                     "black (sd3)")
    gen.add_argument("--cache", choices=("none", "first_block", "taylorseer"),
                     help="step cache: first_block reuses the later blocks' work on steps that change little, "
                          "taylorseer predicts the attention between steps that compute (qwen_image, flux, sd3; "
                          "default: the model's)")
    gen.add_argument("--cache-threshold", type=float, help="with --cache first_block: at most this relative change "
                     "of the first block reuses (default: the model's, else 0.05; higher: faster, less faithful)")
    gen.add_argument("--frames", type=_positive, dest="num_frames", help="num_frames (video models)")
    gen.add_argument("--fps", type=float, dest="frame_rate", help="frame_rate (LTX-2)")
    gen.add_argument("--think", action="store_true", default=None,
                     help="first decode a plan (an image) or reasoning (a text answer), printed as it streams (bagel)")
    gen.add_argument("--output-modality", choices=("image", "text"),
                     help="text: answer the prompt in text, printed as it streams, no image (bagel)")
    gen.add_argument("--max-new-tokens", type=_positive, help="most tokens of the thought or answer (bagel)")
    gen.add_argument("--temperature", type=float, help="text sampling temperature; 0: greedy (bagel's default)")
    gen.add_argument("--preview-every", type=_non_negative,
                     help="a progress response with a preview every K steps (default 1, with --think or "
                          "--output-modality 0; 0: final image only, as bagel needs)")
    gen.add_argument("--preview-dir", type=Path, help="save the previews here")
    gen.add_argument("--out", type=Path, default=Path("out.png"),
                     help="output PNG; several images become out-0.png, out-1.png, ... Videos: .mp4, .npy "
                          "(raw frames) or .wav (sound)")
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
    if args.http and args.out.suffix.lower() in (".npy", ".wav"):
        parser.error("--out .npy/.wav needs gRPC: HTTP generate_stream sends tensors as flat lists, without "
                     "their shape (use .mp4 over HTTP)")
    return args


def _images(paths: Optional[list]) -> Union[None, bytes, list]:
    """`--image` files: one file's bytes, or a list of them when given several times."""
    if not paths:
        return None
    return paths[0].read_bytes() if len(paths) == 1 else [path.read_bytes() for path in paths]


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


VIDEO_SUFFIXES = {".mp4": "mp4", ".npy": "raw", ".wav": "raw"}  # --out suffix -> output_format


def save_video(out: Path, video: Video) -> list[Path]:
    """Write the final response's video as `out` says: mp4 files, the raw frames, or the sound as 16-bit WAV."""
    suffix = out.suffix.lower()
    if suffix == ".npy":
        if video.frames is None:
            raise ResponseFormatError("the final response carries no raw video")
        np.save(out, video.frames)
        return [out]
    if suffix == ".wav":
        if video.audio is None or not video.audio_sample_rate:
            raise ResponseFormatError("this model sends no audio")
        paths = output_paths(out, len(video.audio))
        for path, sound in zip(paths, video.audio):
            with wave.open(str(path), "wb") as wav:
                wav.setnchannels(sound.shape[0])
                wav.setsampwidth(2)
                wav.setframerate(video.audio_sample_rate)
                wav.writeframes((np.clip(sound.T, -1, 1) * 32767).round().astype("<i2").tobytes())
        return paths
    if not video.mp4:
        raise ResponseFormatError("the final response carries no mp4")
    paths = output_paths(out, len(video.mp4))
    for path, data in zip(paths, video.mp4):
        path.write_bytes(data)
    return paths


def _chunk_note(chunk: Video) -> str:
    start = chunk.frame_offset or 0
    if chunk.frames is None:
        return f"chunk from frame {start}"
    return f"chunk: frames {start}-{start + chunk.frames.shape[1] - 1}"


def run_generate(args: argparse.Namespace) -> int:
    started = time.monotonic()
    bar = ProgressBar()
    output_format = VIDEO_SUFFIXES.get(args.out.suffix.lower())
    text = args.think or args.output_modality is not None  # BAGEL, which sends no previews
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
        num_frames=args.num_frames,
        frame_rate=args.frame_rate,
        preview_interval=args.preview_every if args.preview_every is not None else 0 if text else 1,
        output_format=output_format,
        image=_images(args.image),
        strength=args.strength,
        mask=None if args.mask is None else args.mask.read_bytes(),
        cache=args.cache,
        cache_threshold=args.cache_threshold,
        think=args.think,
        output_modality=args.output_modality,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    final, printed = None, ""
    # closing() cancels the request if we leave early (Ctrl-C while saving a preview).
    with contextlib.closing(events), contextlib.closing(bar):
        for event in events:
            if isinstance(event, Progress) and event.text is not None:
                printed += event.text
                print(event.text, end="", flush=True)
            elif isinstance(event, Progress):
                bar.update(event.step, event.num_steps, _chunk_note(event.chunk) if event.chunk else "")
                if event.previews and args.preview_dir is not None:
                    _save_previews(args.preview_dir, event)
            elif isinstance(event, Final):
                final = event
                if bar.shown and final.num_steps:
                    bar.update(final.num_steps, final.num_steps)
    assert final is not None, "stream() ends with a Final or raises"
    if final.text is not None:  # the rest of the text (the whole of it if the streamed part does not lead it)
        print(final.text[len(printed):] if final.text.startswith(printed) else "\n" * bool(printed) + final.text,
              flush=True)
        if not final.images and final.video is None:
            print(f"answered ({final.finish_reason}) in {time.monotonic() - started:.2f} s", file=sys.stderr,
                  flush=True)
            return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if final.video is not None:
        paths = save_video(args.out, final.video)
        print(f"saved {', '.join(str(p) for p in paths)} in {time.monotonic() - started:.2f} s", flush=True)
        return 0
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
