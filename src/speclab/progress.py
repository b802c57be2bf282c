"""Progress: the package logs through one logger, `speclab` (each module's child
`speclab.<module>`); `log_to_stdout` shows its INFO lines as plain `[speclab] ...` lines on
stdout, readable in a terminal, a log file and a notebook executed by papermill alike (a
widget progress bar freezes in a saved notebook). The CLI and the notebooks call it once.
`speclab run` forwards these lines from the notebooks to the terminal (`LineForwarder`)."""

from __future__ import annotations

import logging
import sys

PREFIX = "[speclab]"


def duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 1 h 02 min."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Lines(logging.StreamHandler):
    """`[speclab] message` on the stdout of the moment (a notebook kernel or a test capture
    replaces sys.stdout after the handler exists)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(f"{PREFIX} %(message)s"))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _):
        pass


def log_to_stdout() -> None:
    """Show the `speclab` logger's INFO lines as progress lines (once per process)."""
    log = logging.getLogger("speclab")
    if not any(isinstance(h, Lines) for h in log.handlers):
        log.addHandler(Lines())
        log.setLevel(logging.INFO)
        log.propagate = False


class LineForwarder:
    """A file-like sink for a notebook's stdout (papermill's `stdout_file`): complete lines
    that start with PREFIX are written to `out`, tagged with the notebook's name."""

    def __init__(self, tag: str, out=None):
        self.tag, self.out, self.buf = tag, out or sys.stdout, ""

    def write(self, text: str) -> int:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            line = line.split("\r")[-1]
            if line.startswith(PREFIX):
                self.out.write(f"{PREFIX} [{self.tag}]{line[len(PREFIX):]}\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()
