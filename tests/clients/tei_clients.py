"""Run TEI clients against a server; print what they got as JSON.

Run by tests/integration/test_clients.py in a subprocess, with the test extra's Python
(huggingface_hub 2.x) or the one of .venv-hub1 (huggingface_hub 1.x, which
langchain-huggingface needs): one script for both, so each client is checked the same way.

    python tests/clients/tei_clients.py URL CLIENT... < texts.json

CLIENT is one of hub, hub-async, langchain-huggingface, haystack-text, haystack-document.
Each runs with the client's defaults (only the URL is given) and reports, per text, the
vector it returned, plus what ``get_endpoint_info`` and ``health_check`` say (hub clients).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any


def hub(url: str, texts: list[str]) -> dict[str, Any]:
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=url)
    # get_endpoint_info and health_check exist only for provider="hf-inference" (the client
    # raises ValueError before any request otherwise); feature_extraction works either way.
    endpoint = InferenceClient(model=url, provider="hf-inference")
    return {"vectors": [client.feature_extraction(t)[0].tolist() for t in texts],
            "endpoint_vectors": [endpoint.feature_extraction(t)[0].tolist() for t in texts],
            "info": endpoint.get_endpoint_info(), "healthy": endpoint.health_check()}


def hub_async(url: str, texts: list[str]) -> dict[str, Any]:
    from huggingface_hub import AsyncInferenceClient

    async def run() -> dict[str, Any]:
        client = AsyncInferenceClient(model=url)
        endpoint = AsyncInferenceClient(model=url, provider="hf-inference")
        rows = await asyncio.gather(*(client.feature_extraction(t) for t in texts))
        endpoint_rows = await asyncio.gather(*(endpoint.feature_extraction(t) for t in texts))
        info = await endpoint.get_endpoint_info()
        healthy = await endpoint.health_check()
        for c in (client, endpoint):
            await c.close()
        return {"vectors": [r[0].tolist() for r in rows],
                "endpoint_vectors": [r[0].tolist() for r in endpoint_rows],
                "info": info, "healthy": healthy}

    return asyncio.run(run())


def langchain_huggingface(url: str, texts: list[str]) -> dict[str, Any]:
    from langchain_huggingface import HuggingFaceEndpointEmbeddings

    embeddings = HuggingFaceEndpointEmbeddings(model=url)
    vectors = embeddings.embed_documents(texts)
    query = embeddings.embed_query(texts[0])
    async_vectors = asyncio.run(embeddings.aembed_documents(texts))
    return {"vectors": vectors, "query": query, "async_vectors": async_vectors}


def haystack_text(url: str, texts: list[str]) -> dict[str, Any]:
    from haystack_integrations.components.embedders.huggingface_api import (
        HuggingFaceAPITextEmbedder,
    )

    embedder = HuggingFaceAPITextEmbedder(
        api_type="text_embeddings_inference", api_params={"url": url}
    )
    return {"vectors": [embedder.run(text=t)["embedding"] for t in texts]}


def haystack_document(url: str, texts: list[str]) -> dict[str, Any]:
    from haystack import Document
    from haystack_integrations.components.embedders.huggingface_api import (
        HuggingFaceAPIDocumentEmbedder,
    )

    embedder = HuggingFaceAPIDocumentEmbedder(
        api_type="text_embeddings_inference", api_params={"url": url}
    )
    documents = embedder.run(documents=[Document(content=t) for t in texts])["documents"]
    return {"vectors": [d.embedding for d in documents]}


CLIENTS = {
    "hub": hub,
    "hub-async": hub_async,
    "langchain-huggingface": langchain_huggingface,
    "haystack-text": haystack_text,
    "haystack-document": haystack_document,
}


def main() -> None:
    url, names = sys.argv[1], sys.argv[2:]
    texts = json.load(sys.stdin)
    import huggingface_hub

    out: dict[str, Any] = {"huggingface_hub": huggingface_hub.__version__}
    for name in names:
        out[name] = CLIENTS[name](url, texts)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
