"""What travels on the engine's socket: typed frames (msgspec Structs, MessagePack).

A front sends ``Hello`` (and gets the engine's ``Card``), ``Reserve`` (room for a request,
before it is tokenized; ``Granted`` back when it asked to be told), ``Submit`` (one
``Work``'s model side: the kind, the token ids, the options) or ``Submits`` (several of
either in one frame), ``Cancel`` (its client left), ``Ping`` and ``Snapshot`` (its metrics);
the engine answers ``Answer`` (a kind's arrays) or ``Failed`` for a request, ``Rows`` for the
one-input dense embeddings of a batch (one float32 array, a row each), or ``Answers``
(several of these in one frame), ``Pong`` with its state, and ``Exposition`` for ``Scrape`` (a
``Snapshot`` that asks for the merged metrics back). Ids,
rows and sparse pairs travel as raw little-endian arrays, not lists. A frame is decoded
into exactly these types or refused: nothing on the socket is ever unpickled or executed.

>>> frame = encode(Submit(7, "embed", *pack_ids([[101, 7, 102]]), timeout=5.0))
>>> got = decode_to_engine(frame)
>>> got.id, unpack_ids(got.ids, got.lengths, got.seconds)
(7, [[101, 7, 102]])
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from ..metrics import Family  # typed: the decoder refuses a family of another shape
from ..work import Pair, Pixels

# A process id where one is named (0: none); a negative one would name a process group to
# os.kill, and one past the largest pid Linux makes names no process.
Pid = Annotated[int, msgspec.Meta(ge=0, le=4194304)]
Size = Annotated[int, msgspec.Meta(ge=0)]


class Frame(msgspec.Struct, tag=True, tag_field="frame"):
    """Every frame names its type in its ``frame`` field."""


class Hello(Frame):
    pid: Pid


class Reserve(Frame):
    """Room for one request in the engine's admission, asked before the front tokenizes it,
    as one process reserves it (docs/batching.md): its kind (one this model does not serve
    is refused now), its inputs, its tokens as estimated, the seconds left before its
    deadline, its flow and tenant. ``tell``: answer ``Granted`` once the room is reserved,
    and the front tokenizes only then; otherwise only a refusal is answered (``Failed``),
    and the ``Submit`` that follows waits in the engine until its room is granted."""

    id: int
    kind: str
    inputs: Size
    tokens: Size
    timeout: float = 30.0
    flow: str | None = None
    tenant: str | None = None
    front: Pid = 0
    tell: bool = False


class Granted(Frame):
    """A ``Reserve`` that asked to be told has its room."""

    id: int


class Submit(Frame):
    """One ``Work`` for the model: its wrapped ids (flat int32, and each input's length;
    ``seconds``: where a pair's second segment starts, for scorers), its options, and the
    seconds left before its deadline (clocks are not compared across processes).
    ``reserved``: its room was asked by the ``Reserve`` of the same id (a front's always
    is); where that was refused or withdrawn, its ``Failed`` has gone and the submit is
    dropped. Without it the engine admits the request on arrival."""

    id: int
    kind: str
    ids: bytes
    lengths: bytes
    seconds: bytes = b""
    raw: bool = False
    timeout: float = 30.0
    flow: str | None = None
    tenant: str | None = None
    front: Pid = 0  # the sending front's pid
    # images (image-text models): which inputs they are (int32 positions, whose ids are
    # empty), and their pixels, one float32 (channels, height, width) array each
    images: bytes = b""
    pixels: bytes = b""
    image_shape: tuple[Size, ...] = ()
    reserved: bool = False
    # its answer wanted at unit length (a normalised embedding, whole): the engine sends the
    # row its batch normalised where it has one (a one-input request's), and says so
    unit: bool = False


class Cancel(Frame):
    id: int
    # why the front gave the request up, when its inputs are to be counted dropped by the
    # engine ("disconnected", "timeout"); empty when not: the front counted them, or they
    # are no drop (a 400 found as it tokenized, the engine gone)
    dropped: str = ""


class Ping(Frame):
    pid: Pid


class Snapshot(Frame):
    """A front's own metrics, as families of samples (``Metrics.snapshot``: its origin, the
    sequence number that orders its snapshots, the families)."""

    pid: Pid
    origin: int
    seq: int
    families: list[Family]


class Scrape(Snapshot):
    """A scrape: the asking front's live metrics, kept as its snapshot, then every front's
    and the engine's merged and sent back (``Exposition``)."""


class Card(Frame):
    """What a front needs of the model: its description, its tokenizer, and the engine."""

    info: dict[str, Any]
    text: dict[str, Any]
    pid: int
    state: str
    queue_limit: int


class Pong(Frame):
    """The engine's state, and the ids of the asking front's requests it holds (queued,
    computing): a request that reached the model has no deadline left, and its front
    waits for it while the engine still lists it."""

    pid: int
    state: str
    queue_limit: int
    fronts: list[int] = []
    holding: list[int] = []


# An answer's arrays: little-endian float32 or int32, each with its shape
ArrayType = Literal["<f4", "<i4"]


class Answer(Frame):
    """A computed answer, as its kind packs it (kinds.py ``Kind.pack``): raw arrays, each
    with its type and shape, and where the request's time went."""

    id: int
    parts: list[bytes]
    types: list[ArrayType]
    shapes: list[tuple[Size, ...]]
    queue_s: float
    inference_s: float
    batch_size: int = 0  # the inputs of the largest batch that held this request's
    unit: bool = False  # its rows are at unit length already (``Submit.unit``)


class Rows(Frame):
    """The answers of one front's one-input requests for dense rows in one batch: one
    float32 array of ``width`` columns whose row ``k`` is request ``ids[k]``'s, and where
    each one's time went. One copy of the batch's rows and one frame for all, where an
    ``Answer`` each cost the engine a slice, a struct and its encoding a request. ``unit``:
    the rows are at unit length already (``Submit.unit``)."""

    ids: list[int]
    rows: bytes
    width: Size
    queue_s: list[float]
    inference_s: float
    batch_size: int = 0
    unit: bool = False


class Row:
    """Request ``frame.ids[at]``'s answer in a ``Rows`` frame, as a front's request waits
    for it (``row``: a read-only view of its bytes, no copy)."""

    __slots__ = ("frame", "at")

    def __init__(self, frame: Rows, at: int) -> None:
        self.frame = frame
        self.at = at

    @property
    def id(self) -> int:
        return self.frame.ids[self.at]

    def row(self) -> np.ndarray:
        """The one row, as a (1, width) float32 array; ValueError where the frame's rows
        do not hold its ids' rows."""
        frame = self.frame
        width = frame.width
        if not width or len(frame.rows) != 4 * width * len(frame.ids) \
                or len(frame.queue_s) != len(frame.ids):
            raise ValueError("the rows of an answer do not hold its requests' rows")
        row = np.frombuffer(frame.rows, dtype="<f4", count=width,
                            offset=4 * width * self.at).reshape(1, width)
        return row if _NATIVE else host_order(row)


class Failed(Frame):
    """An ``ApiError`` of the model side, to be raised again in the front."""

    id: int
    status: int
    type: str
    reason: str
    message: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = {}
    empty_s: float = 0.0  # a tenant's spent rate quota: how long it stays spent
    error: str = ""  # the class's name: classes can share a status, a type and a reason


class Exposition(Frame):
    """Every front's and the engine's metrics, merged: the answer to the ``Scrape`` whose
    ``seq`` it carries (a late answer to a scrape that gave up answers no other)."""

    families: list[Any]
    seq: int = 0


class Submits(Frame):
    """A burst of one front's ``Reserve``s and ``Submit``s in one frame, in the order its
    request threads queued them while one send was under way (one wake-up and one decode in
    the engine for all)."""

    items: list[Reserve | Submit]


class Answers(Frame):
    """What one turn of the engine's loop has for one front (the answers of every request
    of that front that a batch finished, its rows as one ``Rows`` where they are a batch's
    dense rows, the grants of its reservations), in one frame:
    one send, one wake-up of the front's reader."""

    items: list[Answer | Rows | Failed | Granted]


ToEngine = Hello | Reserve | Submit | Submits | Cancel | Ping | Snapshot | Scrape
ToFront = Card | Pong | Answer | Rows | Failed | Granted | Answers | Exposition

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_to_front = msgspec.msgpack.Decoder(ToFront)


def encode(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_to_engine(data: bytes | bytearray) -> Any:
    """A front's frame; ``msgspec.DecodeError`` (a ``ValueError``) for anything else."""
    return _to_engine.decode(data)


def decode_to_front(data: bytes | bytearray) -> Any:
    return _to_front.decode(data)


def max_frame_bytes(inputs: int, tokens: int, image_bytes: int = 0) -> int:
    """The largest frame a front sends for requests of at most ``inputs`` inputs of at most
    ``tokens`` tokens (and ``image_bytes`` of pixels): 4 bytes an id, 8 an input (its length,
    a pair's second segment), and a margin for the rest. The engine's socket closes a larger
    sender's connection."""
    return 4 * inputs * tokens + 8 * inputs + image_bytes + (1 << 20)


def pack_ids(ids: Sequence[Sequence[int]]) -> tuple[bytes, bytes, bytes]:
    """Wrapped ids as flat int32 bytes, each input's length, and pairs' second segments."""
    seconds = b""
    if ids and isinstance(ids[0], Pair):
        seconds = _int32_bytes([p.second for p in ids])  # type: ignore[attr-defined]
    flat = _int32_bytes([i for row in ids for i in row])
    return flat, _int32_bytes([len(row) for row in ids]), seconds


def pack_pixels(ids: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """An image work's inputs as ``pack_ids`` takes them (each image's ids empty), and the
    ``Submit`` fields of its images (none when there are none)."""
    at = [i for i, row in enumerate(ids) if isinstance(row, Pixels)]
    if not at:
        return list(ids), {}
    stacked = np.stack([ids[i].array for i in at]).astype("<f4", copy=False)
    rows = [() if isinstance(row, Pixels) else row for row in ids]
    return rows, {"images": _int32_bytes(at), "pixels": stacked.tobytes(),
                  "image_shape": tuple(int(n) for n in stacked.shape[1:])}


def unpack_pixels(frame: Submit, ids: list[Any], shape: tuple[int, ...], cost: int) -> None:
    """``frame``'s images into ``ids`` at their positions, each a ``Pixels`` of ``cost``;
    ValueError where they are not images of ``shape`` at empty inputs' places."""
    at = _int32s(frame.images)
    if tuple(frame.image_shape) != tuple(shape):
        raise ValueError(f"images of shape {tuple(frame.image_shape)}, not the model's {shape}")
    if len(set(at)) != len(at) or any(not 0 <= i < len(ids) or ids[i] for i in at):
        raise ValueError("an image's position is not an empty input's")
    if len(frame.pixels) != 4 * len(at) * math.prod(shape):
        raise ValueError("the pixels do not hold the images")
    arrays = np.frombuffer(frame.pixels, dtype="<f4").reshape((len(at), *shape))
    if not _NATIVE:
        arrays = host_order(arrays)
    if not np.isfinite(arrays).all():
        raise ValueError("a pixel that is not a number")
    for i, array in zip(at, arrays, strict=True):
        ids[i] = Pixels(array, cost)


def unpack_ids(flat: bytes, lengths: bytes, seconds: bytes = b"", *, vocab: int | None = None,
               longest: int | None = None) -> list[list[int]]:
    """``pack_ids``' inverse; ValueError for arrays that do not add up, and for an id
    outside ``range(vocab)`` or an input longer than ``longest`` (checked on the flat
    arrays: a look at each input cost the engine a few calls an input). The ids and
    lengths are read unsigned: a negative one reads as 2**31 or more, so that one bound
    refuses both ends (a ``min`` and a ``max`` of the ids cost more than the rest)."""
    if len(flat) % 4 or len(lengths) % 4:
        raise ValueError("the ids and their lengths do not add up")
    if _LITTLE:  # one C call an array (``_uint32s``), where a struct format is built, parsed
        values = memoryview(flat).cast("I").tolist()
        sizes = memoryview(lengths).cast("I").tolist()
    else:
        values, sizes = _uint32s(flat), _uint32s(lengths)
    if len(sizes) == 1:  # a query's frame: its one input is every id
        longest_size = sizes[0]
        if longest_size != len(values):
            raise ValueError("the ids and their lengths do not add up")
        rows = [values]
    else:
        if sum(sizes) != len(values):
            raise ValueError("the ids and their lengths do not add up")
        longest_size = max(sizes, default=0)
        rows, at = [], 0
        for size in sizes:
            rows.append(values[at:at + size])
            at += size
    if vocab is not None and values and max(values) >= vocab:
        raise ValueError("a token id outside the vocabulary")
    if longest is not None and longest_size > longest:
        raise ValueError("an input longer than the model's limit")
    if not seconds:
        return rows
    second = _int32s(seconds)
    if len(second) != len(rows):
        raise ValueError("a pair's second segment is missing")
    return [Pair(row, s) for row, s in zip(rows, second, strict=True)]


def _uint32s(data: bytes) -> list[int]:
    """Little-endian 32-bit values, unsigned (``data``'s length a multiple of 4)."""
    return list(struct.unpack(f"<{len(data) >> 2}I", data))


# the wire's arrays are little-endian: read on a little-endian host as they are; on a
# big-endian one a copy in the host's order, where a float32 array in the wire's order is
# not ``np.float32`` to the checks that read it (``Kind.unpack``), nor native to a runtime
_NATIVE = sys.byteorder == "little"
_LITTLE = _NATIVE and struct.calcsize("I") == 4


# struct, not numpy: a request's frame holds a few dozen ids, for which numpy's cost per call
# was most of the engine's work on a frame (and of the front's on a request).
def _int32_bytes(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def _int32s(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError("the ids and their lengths do not add up")
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def answer(request_id: int, arrays: Sequence[np.ndarray], queue_s: float, inference_s: float,
           batch_size: int) -> Answer:
    """The ``Answer`` frame of ``arrays`` (float32 or int32)."""
    if _NATIVE and len(arrays) == 1 and arrays[0].dtype == np.float32:  # dense vectors
        (vectors,) = arrays
        return Answer(request_id, [vectors.tobytes()], ["<f4"], [vectors.shape], queue_s,
                      inference_s, batch_size)
    types: list[ArrayType] = ["<f4" if a.dtype.kind == "f" else "<i4" for a in arrays]
    parts = [np.ascontiguousarray(a, dtype=t).tobytes() for a, t in zip(arrays, types,
                                                                         strict=True)]
    return Answer(request_id, parts, types, [tuple(int(n) for n in a.shape) for a in arrays],
                  queue_s, inference_s, batch_size)


def arrays(frame: Answer) -> list[np.ndarray]:
    """An ``Answer``'s arrays (read-only views, no copy); ValueError where a part's bytes
    are not its shape's."""
    if not len(frame.parts) == len(frame.types) == len(frame.shapes):
        raise ValueError("an answer's parts, types and shapes do not match")
    out = []
    for data, kind, shape in zip(frame.parts, frame.types, frame.shapes, strict=True):
        if len(data) != 4 * math.prod(shape):
            raise ValueError("an answer's part does not hold its shape")
        array = np.frombuffer(data, dtype=kind).reshape(shape)
        out.append(array if _NATIVE else host_order(array))
    return out


def host_order(array: np.ndarray) -> np.ndarray:
    """``array`` in the host's byte order (a copy where it is not)."""
    return array.astype(array.dtype.newbyteorder("="), copy=False)
