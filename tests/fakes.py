"""Test doubles shared by the unit and integration tests."""

import threading

from embedsvc.model.fake import FakeEncoder


class GatedEncoder(FakeEncoder):
    """A fake whose device stays busy with a batch until the test opens the gate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def hold(self):
        self.gate.clear()
        self.entered.clear()

    def encode(self, batch):
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().encode(batch)


class BundledTokenizerFake(FakeEncoder):
    """The bundled model's real tokenizer (through the same bounded window as the real
    encoder) in front of the fake device: tokenizing costs what it costs in production."""

    def __init__(self, **kwargs):
        from pathlib import Path

        from tokenizers import Tokenizer

        from embedsvc.model.encoder import bundled_model_path

        super().__init__(max_input_tokens=256, **kwargs)
        self.tokenizer = Tokenizer.from_file(str(Path(bundled_model_path()) / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()

    def tokenize(self, texts, limit=None, direction="right"):
        from embedsvc.model.window import token_window

        return [ids for ids, _ in token_window(self.tokenizer, texts, limit, direction, 6)]

    def wrap(self, ids):
        return [101, *ids, 102]

    def encode(self, batch):
        return super().encode([[i % 997 for i in ids] for ids in batch])  # fit the fake's rows
