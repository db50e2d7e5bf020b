"""Export an image-text model (CLIP, SigLIP) as a record of two ONNX towers (torch extra;
issue 48), which lean.py's ``LeanImageText`` serves without PyTorch.

``model.onnx`` (the record's GRAPH): (input_ids, attention_mask) -> text_embeds, the model's
``get_text_features``; ``vision.onnx``: pixel_values (float32 NCHW, image/preprocess.py's
output) -> image_embeds, ``get_image_features``. Both as the model computes them,
unnormalised: its heads (SigLIP's ``pooler_output``, CLIP's EOS pooling and projection) stay
inside the graphs. Beside them, as for every record (record.py): ``tokenizer.json`` (no
padding, no truncation), ``preprocessor_config.json`` as the model ships it, ``probe.npz``
(PyTorch's outputs on probe texts and images) and ``record.json``.

What differs between models is read from their files, not their names:

- the text padding: a model whose text tower pools a fixed position (``model_type``
  ``siglip``/``siglip2``: the last one) is fed texts padded to ``max_position_embeddings``,
  as its processor's ``padding="max_length"`` does, else a text's vector would depend on
  its batch-mates; others pad to the batch's longest;
- the attention mask: fed only where the tokenizer's ``model_input_names`` has one (SigLIP's
  has not: its tower attends to the padding, as transformers runs it);
- an image's cost: its tower's patches and class token, ``(image_size / patch_size)^2 + 1``.

Refused in one line (``unsupported``): a model whose config ships its own modeling code
(``auto_map``: jina-clip, nomic-embed-vision), and SigLIP 2's NaFlex checkpoints (variable
patches per image); fixed-resolution SigLIP 2 checkpoints are SigLIP models and served.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .record import GRAPH, PREPROCESSOR, PROBE, TOKENIZER, VISION, describe_file, write_record
from .tokenizer import template_ids, tokenizer_from_json

log = logging.getLogger(__name__)

OPSET = 17
_PROBE = ["a probe", "a photo of a cat on a red sofa", "x"]  # within any tower's length
_FIXED_LENGTH = ("siglip", "siglip2")  # text towers that pool the last position


def features(output: Any) -> Any:
    """The embedding tensor of a ``get_*_features`` call: transformers 5 wraps it."""
    return output if hasattr(output, "shape") else output.pooler_output


def is_image_text(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is an image-text model's: a text and a vision tower."""
    return isinstance(config.get("text_config"), dict) and \
        isinstance(config.get("vision_config"), dict)


def unsupported(source: Path) -> str | None:
    """Why the image-text model in ``source`` cannot be exported, or None."""
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if "auto_map" in config:  # jina-clip, nomic-embed-vision: code shipped with the weights
        return ("its config names modeling code of its own (auto_map), which embedsvc does "
                "not run; its towers are not transformers' CLIP or SigLIP")
    if config.get("model_type") == "siglip2":
        return ("SigLIP 2's NaFlex checkpoints preprocess each image at its own aspect ratio "
                "into a variable number of patches, which this path does not; the "
                "fixed-resolution SigLIP 2 checkpoints (model_type siglip) are served")
    missing = [n for n in (TOKENIZER, PREPROCESSOR) if not (source / n).is_file()]
    if missing:
        return f"its directory has no {' and no '.join(missing)}"
    return None


def build_image_record(source: Path, key: str, path: Path, *, name: str,
                       kind_setting: str = "auto") -> None:
    """Write the record of the image-text model in ``source`` into the new directory
    ``path``; record.RecordError where its graphs do not reproduce PyTorch's outputs."""
    import tokenizers
    import transformers

    reason = unsupported(source)
    if reason is not None:
        raise RuntimeError(f"{name} is not served: {reason}")
    path.mkdir()
    model = transformers.AutoModel.from_pretrained(str(source)).float().eval()
    config = model.config
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    tok = tokenizers.Tokenizer.from_file(str(source / TOKENIZER))
    tok.no_padding()
    tok.no_truncation()
    tok.save(str(path / TOKENIZER))
    shutil.copyfile(source / PREPROCESSOR, path / PREPROCESSOR)
    image_config = json.loads((source / PREPROCESSOR).read_text(encoding="utf-8"))
    text_cfg, vision_cfg = config.text_config, config.vision_config
    max_tokens = int(text_cfg.max_position_embeddings)
    fixed = max_tokens if config.model_type in _FIXED_LENGTH else None
    masked = "attention_mask" in hf_tokenizer.model_input_names
    pad_id = hf_tokenizer.pad_token_id
    pad_id = int(pad_id if pad_id is not None else getattr(text_cfg, "pad_token_id", 0) or 0)
    prefix, suffix = template_ids(tokenizer_from_json(tok.to_str()))
    ids = [list(row) for row in hf_tokenizer(_PROBE, add_special_tokens=True)["input_ids"]]
    # what the vision tower takes (its preprocessor gives every image this shape)
    shape = (int(getattr(vision_cfg, "num_channels", 3)), vision_cfg.image_size,
             vision_cfg.image_size)
    pixels = np.random.default_rng(0).standard_normal((2, *shape)).astype(np.float32)
    feeds = _text_feeds(ids, pad_id, fixed, masked)
    export_towers(model, path, shape=shape, text_length=feeds["input_ids"].shape[1])
    np.savez(path / PROBE, text_embeds=_torch(model, feeds), pixels=pixels,
             image_embeds=_torch_images(model, pixels))
    size = vision_cfg.image_size // vision_cfg.patch_size
    info = {"name": name, "dimension": int(np.load(path / PROBE)["text_embeds"].shape[1]),
            "max_input_tokens": max_tokens, "vocab_size": tok.get_vocab_size(True),
            "parameters": sum(p.numel() for p in model.parameters()),
            "prompts": {}, "labels": [], "pooling": None,
            "modalities": ["text", "image"], "image_tokens": size * size + 1,
            "image": image_config}
    fields = {
        "fingerprint": key, "kind_setting": kind_setting, "lean": True, "kind": "image-text",
        "tokenizer": {"pad_id": pad_id, "token_types": False, "prefix": prefix,
                      "suffix": suffix, "truncate_at": max_tokens},
        "towers": {"text_length": fixed, "text_mask": masked, "model_type": config.model_type},
        "probe": {"inputs": _PROBE, "ids": ids}}
    _store(path, fields, info)


def _store(path: Path, fields: dict[str, Any], info: dict[str, Any]) -> None:
    """``record.json`` over the two towers, their large weights stored as float16 where the
    probe still reproduces PyTorch's outputs (export.py's ``half_weights``, as text records
    store theirs: half the record), else as exported; RecordError when not even that does."""
    import onnx

    from .export import half_weights, reproduces

    exported = {name: onnx.load(str(path / name)) for name in (GRAPH, VISION)}
    halves = {name: half_weights(graph) for name, graph in exported.items()}
    for storage in ("float16", "float32"):
        if storage == "float16" and not any(count for _, count in halves.values()):
            continue
        for name, graph in exported.items():
            onnx.save(halves[name][0] if storage == "float16" else graph, str(path / name))
        files = (GRAPH, VISION, TOKENIZER, PREPROCESSOR, PROBE)
        sized = {**info, "size_bytes": sum((path / n).stat().st_size for n in (GRAPH, VISION))}
        write_record(path, {**fields, "info": sized, "weights": storage,
                            "files": {n: describe_file(path / n) for n in files}})
        if not reproduces(path, storage, info["name"]):
            continue
        log.info("exported %s: text and vision towers, weights stored as %s, %.1f MiB",
                 info["name"], storage, sized["size_bytes"] / 2**20)
        return


def _text_feeds(ids: list[list[int]], pad_id: int, fixed: int | None, masked: bool
                ) -> dict[str, np.ndarray]:
    """The probe texts as ``LeanImageText.features`` feeds them."""
    from .tokenizer import padded

    input_ids, mask = padded(ids, pad_id)
    width = max(fixed or 0, input_ids.shape[1])
    extra = ((0, 0), (0, width - input_ids.shape[1]))
    input_ids, mask = np.pad(input_ids, extra, constant_values=pad_id), np.pad(mask, extra)
    return {"input_ids": input_ids, "attention_mask": mask if masked else np.ones_like(mask)}


def _torch(model: Any, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return features(model.get_text_features(
            input_ids=torch.from_numpy(feeds["input_ids"]),
            attention_mask=torch.from_numpy(feeds["attention_mask"]))).numpy()


def _torch_images(model: Any, pixels: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return features(model.get_image_features(pixel_values=torch.from_numpy(pixels))).numpy()


def export_towers(model: Any, out_dir: Path, *, shape: tuple[int, int, int],
                  text_length: int) -> None:
    """Write ``model``'s two towers to ``out_dir`` (batch and text length dynamic)."""
    import warnings

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
    pixels = torch.zeros((2, *shape))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer notes about shapes; the probe checks them
        torch.onnx.export(Text(), (ids, torch.ones_like(ids)), str(out_dir / GRAPH),
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

