"""A dependency-free text progress bar on stderr.

On a terminal it redraws one line; otherwise (pipes, logs, tests) it prints
one line per update so each step can be read as it happens.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    """Shows `step/num_steps` with a bar and the elapsed seconds."""

    def __init__(self, stream: Optional[TextIO] = None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width = width
        self.started = time.monotonic()
        self.tty = self.stream.isatty()
        self._drawn = False
        self.shown = False  # any update yet (the server sends steps only with previews)

    def update(self, step: int, num_steps: int, note: str = "") -> None:
        filled = self.width * step // num_steps if num_steps > 0 else 0
        bar = "#" * filled + "." * (self.width - filled)
        self.shown = True
        line = f"[{bar}] step {step}/{num_steps} {time.monotonic() - self.started:.1f}s" + (f" {note}" if note else "")
        if self.tty:
            self.stream.write("\r" + line)
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line so later output starts on a fresh one."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
