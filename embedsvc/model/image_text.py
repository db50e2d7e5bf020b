"""An image-text model's two ONNX towers served with ONNX Runtime and numpy (issue 48).

No torch: the fronts decode and preprocess images (image/), the engine hands this class the
float32 NCHW pixels, and the text path's tokenizer its token ids. Vectors come back
L2-normalised, texts and images in one space. SigLIP pads text to a fixed length (its
tokenizer's ``max_length`` padding), else a text's vector would depend on its batch-mates:
``text_length`` pads the ids to it here. Not wired yet: the engine will build one for a
record with both graphs, images batching with images (one device batch a tower).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .image_export import TEXT, VISION


class ImageTextTowers:
    def __init__(self, record: Path, *, text_length: int | None = None, pad_id: int = 0) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        providers = ["CPUExecutionProvider"]
        self.text = ort.InferenceSession(str(record / TEXT), options, providers=providers)
        self.vision = ort.InferenceSession(str(record / VISION), options, providers=providers)
        self.text_length = text_length
        self.pad_id = pad_id

    def embed_images(self, pixels: np.ndarray) -> np.ndarray:
        """Unit vectors of a float32 NCHW batch, as image/preprocess.py makes it."""
        (out,) = self.vision.run(None, {"pixel_values": pixels.astype(np.float32, copy=False)})
        return normalise(out)

    def embed_tokens(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Unit vectors of a token batch, padded to ``text_length`` where the model fixes it."""
        ids, mask = input_ids.astype(np.int64), attention_mask.astype(np.int64)
        if self.text_length is not None and ids.shape[1] < self.text_length:
            extra = ((0, 0), (0, self.text_length - ids.shape[1]))
            ids = np.pad(ids, extra, constant_values=self.pad_id)
            mask = np.pad(mask, extra, constant_values=0)
        (out,) = self.text.run(None, {"input_ids": ids, "attention_mask": mask})
        return normalise(out)


def normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
