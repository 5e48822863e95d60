"""Video (and its sound) as an mp4 file in memory, with PyAV (FFmpeg's libraries inside the `av` wheel).

H.264 (libx264, yuv420p) video at the pipeline's frame rate; an audio track,
when the pipeline makes sound (LTX-2), as AAC. Nothing touches the disk and no
ffmpeg binary is needed.
"""

from __future__ import annotations

import io
from typing import Optional

import numpy as np

VIDEO_CODEC = "libx264"
AUDIO_CODEC = "aac"


def encode_mp4(frames: np.ndarray, frame_rate: float, audio: Optional[np.ndarray] = None,
               sample_rate: int = 0) -> bytes:
    """uint8 frames [F, H, W, 3] (and float audio [C, S] in [-1, 1]) -> the bytes of one mp4 file.

    yuv420p needs even sizes; an odd height or width is padded by one edge row/column.
    """
    import av  # noqa: PLC0415 (only mp4 requests pay the import)
    from fractions import Fraction

    frames = np.asarray(frames, dtype=np.uint8)
    pad = ((0, 0), (0, frames.shape[1] % 2), (0, frames.shape[2] % 2), (0, 0))
    frames = np.pad(frames, pad, mode="edge") if any(p[1] for p in pad) else frames
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        video = container.add_stream(VIDEO_CODEC, rate=Fraction(frame_rate).limit_denominator(1001))
        video.height, video.width = frames.shape[1:3]
        video.pix_fmt = "yuv420p"
        sound = None
        if audio is not None:
            audio = np.asarray(audio, dtype=np.float32)
            sound = container.add_stream(AUDIO_CODEC, rate=int(sample_rate))
            sound.layout = "mono" if audio.shape[0] == 1 else "stereo"
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(video.encode())
        if sound is not None:
            planar = np.ascontiguousarray(np.clip(audio[:2], -1, 1))
            frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=sound.layout.name)
            frame.sample_rate = int(sample_rate)
            for packet in sound.encode(frame):
                container.mux(packet)
            container.mux(sound.encode())
    return buffer.getvalue()


def probe_mp4(data: bytes) -> dict:
    """What an mp4 holds: decoded video frame count and size, and its audio streams (tests, the client)."""
    import av  # noqa: PLC0415

    with av.open(io.BytesIO(data), mode="r") as container:
        audio_streams = len(container.streams.audio)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    height, width = frames[0].shape[:2] if frames else (0, 0)
    return {"frames": len(frames), "height": height, "width": width, "audio_streams": audio_streams}
