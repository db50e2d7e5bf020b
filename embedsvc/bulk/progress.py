"""The progress bar of long commands (``embedsvc embed``), on a terminal or in a log file.

On a terminal tqdm redraws one line in place. Where stderr is a file or a pipe, each redraw
stays in the file, so the bar redraws at most every ``FILE_INTERVAL_S`` and does not print
its last frame a second time when it closes (tqdm's close redraws it to show the overall
rate, which in a file repeats the line).

>>> import io
>>> out = io.StringIO()
>>> with progress_bar(total=3, file=out) as bar:
...     _ = bar.update(3)
...     _ = bar.refresh()  # the last frame, on screen before close
>>> out.getvalue().count("3/3")
1
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm

FILE_INTERVAL_S = 10.0


class _FileBar(tqdm):
    """A tqdm bar for a non-terminal stream: its final frame is printed once."""

    def refresh(self, *args: Any, **kwargs: Any) -> Any:
        shown = super().refresh(*args, **kwargs)
        self._shown_n = self.n
        return shown

    def display(self, msg: str | None = None, pos: int | None = None) -> Any:
        # close() sets disable before its last redraw: skip it if this count is on screen
        if self.disable and msg is None and getattr(self, "_shown_n", None) == self.n:
            return True
        return super().display(msg, pos)


def progress_bar(total: int, *, initial: int = 0, unit: str = "input",
                 file: IO[str] | None = None) -> tqdm:
    """A tqdm bar on ``file`` (default stderr), redrawn in place on a terminal only."""
    stream = sys.stderr if file is None else file
    if _is_terminal(stream):
        return tqdm(total=total, initial=initial, unit=unit, file=stream)
    return _FileBar(total=total, initial=initial, unit=unit, file=stream,
                    mininterval=FILE_INTERVAL_S)


def _is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed
        return False
