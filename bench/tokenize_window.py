"""Cost of tokenizing one maximal body (80 inputs x 200,000 '!') in full vs in a window.

    .venv/bin/python bench/tokenize_window.py full
    .venv/bin/python bench/tokenize_window.py window

Prints wall time and the process's peak resident memory; run each mode in its own process.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

from embedsvc.model.encoder import bundled_model_path
from embedsvc.model.window import token_window


def main(mode: str) -> None:
    tok = Tokenizer.from_file(str(Path(bundled_model_path()) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    texts = ["!" * 200_000] * 80
    started = time.perf_counter()
    if mode == "full":  # what the engine did before: every token, then truncation
        ids = [e.ids[:254] for e in tok.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = [i for i, _ in token_window(tok, texts, 254, "right", 6, offsets=False)]
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert all(len(x) == 254 for x in ids)
    print(f"{mode}: {seconds:.2f} s, peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "window")
