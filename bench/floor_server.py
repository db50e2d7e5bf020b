"""The floor under `embedsvc serve`'s start: ONNX Runtime, tokenizers and the standard library.

    .venv/bin/python bench/floor_server.py --record DIR --port 8092

It loads an export record's graph and tokenizer (``embedsvc export`` writes them), listens on
``--port`` and answers ``POST /embed`` (TEI's shape, ``inputs`` a string or a list) with the
graph's rows: no validation, no batching, no metrics, no settings. bench/coldstart.py starts
it beside `embedsvc serve` with the same record, so what embedsvc adds to the launch-to-first-
answer time is the difference.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import onnxruntime
from tokenizers import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, required=True, help="an export record directory")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    options = onnxruntime.SessionOptions()
    session = onnxruntime.InferenceSession(str(args.record / "model.onnx"), options,
                                           providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    tokenizer = Tokenizer.from_file(str(args.record / "tokenizer.json"))
    tokenizer.enable_padding()
    tokenizer.enable_truncation(256)

    def embed(texts: list[str]) -> list[list[float]]:
        encodings = tokenizer.encode_batch(texts)
        feeds = {"input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                 "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                 "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64)}
        rows = session.run(None, {k: v for k, v in feeds.items() if k in names})[0]
        return rows.tolist()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            inputs = body["inputs"]
            answer = json.dumps(embed([inputs] if isinstance(inputs, str) else inputs)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
