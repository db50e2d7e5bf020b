"""Tiny models of every kind, built with random weights and saved as their libraries save them.

No hub: the tokenizer is the bundled model's; the weights are a 2-layer BERT. They load
through ``embedsvc.kinds.load_model`` like any user's model directory.
"""

from __future__ import annotations

from pathlib import Path

LABELS = ("negative", "neutral", "positive")
MAX_LENGTH = 128


def _tokenizer():
    from transformers import AutoTokenizer

    from embedsvc.model.encoder import bundled_model_path

    return AutoTokenizer.from_pretrained(bundled_model_path())


def _config(tokenizer, **extra):
    from transformers import BertConfig

    # a wide initialisation, so that different inputs get clearly different scores
    return BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512,
        initializer_range=0.3, **extra,
    )


def _save_hf(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_cross_encoder(path: Path, labels: tuple[str, ...] = ("score",), seed: int = 0) -> Path:
    """A BERT sequence classifier saved as a sentence-transformers CrossEncoder."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    config = _config(tokenizer, num_labels=len(labels),
                     id2label=dict(enumerate(labels)),
                     label2id={name: i for i, name in enumerate(labels)})
    raw = _save_hf(BertForSequenceClassification(config), tokenizer,
                   path.with_name(path.name + "-hf"))
    CrossEncoder(str(raw), device="cpu", max_length=MAX_LENGTH).save_pretrained(str(path))
    return path


def build_reranker(path: Path) -> Path:
    """One output label: a reranker."""
    return build_cross_encoder(path, ("score",))


def build_classifier(path: Path) -> Path:
    """Three named labels: a classifier."""
    return build_cross_encoder(path, LABELS, seed=1)


def build_sparse(path: Path, seed: int = 2) -> Path:
    """A BERT masked LM with SPLADE max pooling, saved as a sentence-transformers SparseEncoder."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    mlm = BertForMaskedLM(_config(tokenizer))
    with torch.no_grad():
        # a negative output bias, so that a few hundred vocabulary entries stay active, as in
        # a trained SPLADE, instead of half the vocabulary
        mlm.cls.predictions.bias.fill_(-4.0)
    raw = _save_hf(mlm, tokenizer, path.with_name(path.name + "-hf"))
    transformer = Transformer(str(raw), transformer_task="fill-mask", max_seq_length=MAX_LENGTH)
    SparseEncoder(modules=[transformer, SpladePooling("max")], device="cpu").save_pretrained(
        str(path)
    )
    return path


# Every pooling mode sentence-transformers offers, and two at once (their concatenation).
POOLING_MODES = ("mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean",
                 ("cls", "mean"))


def build_embedding(path: Path, pooling="mean", dense: bool = False, normalize: bool = True,
                    seed: int = 3) -> Path:
    """A BERT with ``pooling``, then optionally a Dense layer (tanh) and Normalize, saved as a
    sentence-transformers model."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import BertModel

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    config = _config(tokenizer)
    raw = _save_hf(BertModel(config), tokenizer, path.with_name(path.name + "-hf"))
    pool = Pooling(config.hidden_size, pooling)
    modules = [Transformer(str(raw), max_seq_length=MAX_LENGTH), pool]
    if dense:
        modules.append(Dense(pool.get_embedding_dimension(), 24,
                             activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save_pretrained(str(path))
    return path


IMAGE_SIZE = 30  # the tiny vision towers' input, in pixels a side (5 x 5 patches of 6)
TEXT_LENGTH = 16  # their text towers' positions (SigLIP pads every text to it)


def build_image_text(path: Path, model_type: str = "clip", seed: int = 0) -> Path:
    """A tiny random CLIP or SigLIP saved as transformers saves it: the model, the bundled
    model's tokenizer (SigLIP's takes no attention mask, as its own tokenizer does) and the
    image processor's ``preprocessor_config.json``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    tower = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                 num_attention_heads=4)
    text = dict(tower, vocab_size=tokenizer.vocab_size, max_position_embeddings=TEXT_LENGTH,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                eos_token_id=tokenizer.sep_token_id)
    vision = dict(tower, image_size=IMAGE_SIZE, patch_size=6)
    if model_type == "clip":
        config = transformers.CLIPConfig(text_config=text, vision_config=vision,
                                         projection_dim=24)
        model = transformers.CLIPModel(config)
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                    crop_size=IMAGE_SIZE)
    else:
        model = transformers.SiglipModel(transformers.SiglipConfig(text_config=text,
                                                                   vision_config=vision))
        processor = transformers.SiglipImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            tokenizer.name_or_path, model_input_names=["input_ids"])
    _save_hf(model.eval(), tokenizer, path)
    processor.save_pretrained(path)
    return path
