"""The baseline users start from: Flask, the model loaded at import, encode per request.

    waitress-serve --threads 32 --port 8090 --call bench.naive_app:create
"""

import os

from flask import Flask, jsonify, request
from sentence_transformers import SentenceTransformer

from embedsvc.model.encoder import bundled_model_path


def create() -> Flask:
    device = os.environ.get("EMBEDSVC_DEVICE", "cpu")
    model = SentenceTransformer(bundled_model_path(), device=device)
    app = Flask("naive")

    @app.post("/v1/embeddings")
    def embeddings():
        texts = request.get_json()["input"]
        texts = [texts] if isinstance(texts, str) else texts
        vectors = model.encode(texts)
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()}
                for i, v in enumerate(vectors)]
        return jsonify({"object": "list", "data": data, "model": "naive",
                        "usage": {"prompt_tokens": 0, "total_tokens": 0}})

    return app
