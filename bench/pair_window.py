"""Cost of tokenizing pairs of long texts for a reranker: whole, or through their windows.

    .venv/bin/python bench/pair_window.py whole 5000
    .venv/bin/python bench/pair_window.py window 20000
    .venv/bin/python bench/pair_window.py many 2048

``whole``: one pair of two sides of that many '!' (one token each), truncated by the
tokenizer itself (``longest_first`` to 512, as a BERT CrossEncoder's call does); ``window``:
the same pair as the server reads it (model/pairs.py ``tokenize_pairs``: the windows, the
truncation's shares, the template); ``many``: one 200,000-'!' query against that many
documents of about 600 tokens, as the server reads them (the tokenizer's own truncation of
as few as 256 of those pairs takes more than 24 GiB). Prints CPU time and the process's
peak resident memory; run each in its own process.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tokenizers import Tokenizer

from embedsvc.model.encoder import bundled_model_path
from embedsvc.model.pairs import tokenize_pairs

LIMIT = 512
MARGIN = 6  # the bundled tokenizer's longest added token


def tokenizers() -> tuple[Tokenizer, Tokenizer]:
    plain = Tokenizer.from_file(str(Path(bundled_model_path()) / "tokenizer.json"))
    plain.no_truncation()
    plain.no_padding()
    truncating = Tokenizer.from_str(plain.to_str())
    truncating.enable_truncation(LIMIT)
    return plain, truncating


def main(mode: str, size: int) -> None:
    plain, truncating = tokenizers()
    if mode == "many":
        query = "!" * 200_000
        pairs = [(query, f"document {i} " + "berlin museums ! " * 200) for i in range(size)]
    else:
        pairs = [("!" * size, "!" * (size - 1))]
    started = time.process_time()
    if mode == "whole":
        ids = [e.ids for e in truncating.encode_batch(pairs)]
    else:
        encoder = SimpleNamespace(_tokenizer=plain, _margin=MARGIN,
                                  info=SimpleNamespace(max_input_tokens=LIMIT))
        ids = [list(p) for p in tokenize_pairs(encoder, {"right": truncating}, pairs, "right")]
    seconds = time.process_time() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert all(len(x) == LIMIT for x in ids)
    print(f"{mode} {size}: {seconds:.2f} CPU-s, peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
