"""Test doubles shared by the unit and integration tests."""

import threading

from embedsvc.encoder import FakeEncoder


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
