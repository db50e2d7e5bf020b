"""Export an image-text model (CLIP, SigLIP) as two ONNX towers (torch extra; issue 48).

``text.onnx``: (input_ids, attention_mask) -> text_embeds, ``get_text_features``;
``vision.onnx``: pixel_values (float32 NCHW, image/preprocess.py's output) -> image_embeds,
``get_image_features``. Both as the model computes them, unnormalised: the model's quirks
(SigLIP's ``pooler_output`` head, CLIP's EOS pooling and projection) stay inside the graph.
``image_text.ImageTextTowers`` serves them with ONNX Runtime. Not wired yet: ``export.py``
will call ``export_towers`` for a model whose config has a ``vision_config``, and the record
will list both graphs beside ``preprocessor_config.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OPSET = 17
TEXT, VISION = "text.onnx", "vision.onnx"


def features(output: Any) -> Any:
    """The embedding tensor of a ``get_*_features`` call: transformers 5 wraps it."""
    return output if hasattr(output, "shape") else output.pooler_output


def export_towers(model: Any, out_dir: Path, *, image_size: int, text_length: int) -> None:
    """Write ``model``'s two towers to ``out_dir`` (batch and text length dynamic)."""
    import torch

    class Tower(torch.nn.Module):
        """The model as a submodule, so that the trace sees its weights as parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

    class Text(Tower):
        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return features(self.model.get_text_features(input_ids=input_ids,
                                                         attention_mask=attention_mask))

    class Vision(Tower):
        def forward(self, pixel_values: Any) -> Any:
            return features(self.model.get_image_features(pixel_values=pixel_values))

    model.eval()
    ids = torch.ones((2, text_length), dtype=torch.long)
    pixels = torch.zeros((2, 3, image_size, image_size))
    with torch.no_grad():
        torch.onnx.export(Text(), (ids, torch.ones_like(ids)), str(out_dir / TEXT),
                          input_names=["input_ids", "attention_mask"],
                          output_names=["text_embeds"],
                          dynamic_axes={"input_ids": {0: "batch", 1: "tokens"},
                                        "attention_mask": {0: "batch", 1: "tokens"},
                                        "text_embeds": {0: "batch"}},
                          opset_version=OPSET, dynamo=False)
        torch.onnx.export(Vision(), (pixels,), str(out_dir / VISION),
                          input_names=["pixel_values"], output_names=["image_embeds"],
                          dynamic_axes={"pixel_values": {0: "batch"},
                                        "image_embeds": {0: "batch"}},
                          opset_version=OPSET, dynamo=False)
