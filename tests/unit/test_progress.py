"""progress.py: the bar redraws in place on a terminal; in a file, its last frame once."""

import io

from tqdm import tqdm

from embedsvc.bulk.progress import FILE_INTERVAL_S, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_file_every_frame_is_printed_once():
    out = io.StringIO()
    with progress_bar(total=4, file=out) as bar:
        for _ in range(4):
            bar.update(1)
            bar.refresh()  # as tqdm does when its interval has passed
    frames = [f for f in out.getvalue().replace("\n", "\r").split("\r") if f.strip()]
    counts = [f.split("|")[2].split()[0] for f in frames]
    assert counts == ["0/4", "1/4", "2/4", "3/4", "4/4"]
    assert bar.mininterval == FILE_INTERVAL_S


def test_the_last_frame_is_printed_at_close_when_no_redraw_showed_it():
    out = io.StringIO()
    with progress_bar(total=4, initial=1, file=out) as bar:
        bar.update(3)
    assert out.getvalue().count("4/4") == 1 and out.getvalue().count("1/4") == 1


def test_on_a_terminal_it_is_plain_tqdm():
    bar = progress_bar(total=2, file=Terminal())
    assert type(bar) is tqdm
    bar.close()
