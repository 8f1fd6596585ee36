"""A dependency-free progress bar on stderr."""
import sys
import time


class Progress:
    """``[#####.....] 3/19 case: stage`` redrawn in place on a terminal;
    one line per finished case otherwise (logs stay readable)."""

    def __init__(self, total: int, width: int = 24) -> None:
        self.total, self.width, self.finished = total, width, 0
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def _bar(self) -> str:
        filled = self.width * self.finished // max(self.total, 1)
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.finished}/{self.total}"

    def stage(self, name: str, stage: str) -> None:
        if self.tty:
            line = f"{self._bar()} {name}: {stage}"
            sys.stderr.write("\r\033[K" + line[:120])
            sys.stderr.flush()

    def done(self, name: str) -> None:
        self.finished += 1
        elapsed = time.perf_counter() - self.start
        if self.tty:
            self.stage(name, f"done ({elapsed:.0f}s)")
        else:
            sys.stderr.write(f"{self._bar()} {name} ({elapsed:.0f}s)\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
