"""Safe image decoding: the bytes a client sends, turned into an upright Pillow image or a 400.

Defaults (``ImagePolicy``): data URIs (base64) only; at most 10 MiB an image (encoded);
at most 40 megapixels decoded (a header declaring more is refused BEFORE any pixel is
decoded, and Pillow's own ``Image.MAX_IMAGE_PIXELS`` is set to the same bound, so that its
bomb check raises instead of warning); formats PNG, JPEG, WebP, GIF (first frame) and BMP
only (SVG and everything else refused, Pillow is never asked to guess beyond the list);
truncated images refused (``ImageFile.LOAD_TRUNCATED_IMAGES`` stays False and is checked);
EXIF orientation applied. Every refusal is an ``InvalidImage`` (400, invalid_request_error),
so a route answers it in its family's error shape.

URLs (``http``/``https``) are fetched only when ``ImagePolicy.url_hosts`` lists the host,
with a connect timeout and a read timeout for the whole body, a size cap, no redirects at
all, and never to a loopback, private, link-local, multicast or reserved address: every
address the name resolves to is checked, and the connection goes to the checked address (no
second lookup to rebind). A malformed URL is a 400 like any other refusal.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import io
import ipaddress
import os
import re
import socket
import ssl
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from ..errors import InvalidRequest
from . import require_pillow

if TYPE_CHECKING:
    from PIL.Image import Image

MiB = 1024 * 1024
# images decoded and preprocessed at once in one process: one a CPU (decoders release the
# interpreter lock; more at once would only hold more full-size copies, some 350 MiB each
# for the largest RGBA image MAX_IMAGE_PIXELS lets in)
_SLOTS = threading.BoundedSemaphore(len(os.sched_getaffinity(0)) if hasattr(
    os, "sched_getaffinity") else os.cpu_count() or 1)
_WATCH_S = 0.5  # how often a request waiting for a slot looks at its deadline and client
_CHUNK = 64 * 1024  # a fetched body is read in pieces of at most this
_URL_SAFE = "/%:@!$&'()*+,;=-._~?"  # what a URL's path and query keep as they are
DATA_URI = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?"
                      r"(?P<params>(;[\w.+-]+=(?:[\w.+-]+|\"[\w.+-]*\"))*);base64,",
                      re.ASCII | re.IGNORECASE)
# what base64 text may hold besides its alphabet: the line breaks GNU base64 writes every 76
# characters, and spaces
_BASE64_SPACE = re.compile(rb"[ \t\r\n]+")


class InvalidImage(InvalidRequest):
    """400: an image the service refuses to decode or fetch."""

    def __init__(self, message: str, *, code: str = "invalid_image", param: str | None = None):
        super().__init__(message, code=code, param=param)


@dataclass(frozen=True)
class ImagePolicy:
    max_bytes: int = 10 * MiB
    max_pixels: int = 40_000_000
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    url_hosts: tuple[str, ...] = ()  # empty: URLs refused, data URIs only
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0


DEFAULT = ImagePolicy()


def decode_image(source: str, policy: ImagePolicy = DEFAULT, *,
                 param: str | None = None, where: str = "") -> Image:
    """The image a client named by ``source`` (a data URI, or a URL the policy allows),
    decoded, first frame, EXIF orientation applied."""
    with refusals_named(param, where):
        return decode_bytes(source_bytes(source, policy), policy)


@contextlib.contextmanager
def refusals_named(param: str | None, where: str = "") -> Iterator[None]:
    """An image's refusal raised in the block names the field (``param``, the error shape's)
    and, in its message, which input it was (``where``: "input[3]")."""
    try:
        yield
    except InvalidImage as err:
        err.param = param
        if where:
            err.message = f"{where}: {err.message}"
        raise


def source_bytes(source: str, policy: ImagePolicy = DEFAULT) -> bytes:
    """The encoded bytes ``source`` names: a data URI's, or a URL's the policy allows."""
    scheme = source[:8].lower()  # URI schemes are case-insensitive (RFC 3986)
    if scheme.startswith("data:"):
        return data_uri_bytes(source, policy)
    if scheme.startswith(("http://", "https://")):
        return fetch(source, policy)
    raise InvalidImage("an image must be a base64 data URI (data:image/png;base64,...)"
                       + (" or an http(s) URL" if policy.url_hosts else ""),
                       code="image_source")


@contextlib.contextmanager
def decoding(still_wanted: Callable[[], None]) -> Iterator[None]:
    """Hold one of this process's decode slots (``_SLOTS``) for an image's decoding and
    preprocessing; ``still_wanted`` raises, while it waits, once its request is not (past
    its deadline, its client gone)."""
    while not _SLOTS.acquire(timeout=_WATCH_S):
        still_wanted()
    try:
        yield
    finally:
        _SLOTS.release()


def data_uri_bytes(uri: str, policy: ImagePolicy) -> bytes:
    """The bytes of a base64 data URI, refused before decoding when its text is too long."""
    match = DATA_URI.match(uri)
    if match is None:
        raise InvalidImage("a data URI must read data:<type>;base64,<data>", code="image_source")
    text = uri[match.end():]
    if len(text) * 3 // 4 > policy.max_bytes + 2:
        raise too_large(len(text) * 3 // 4, policy)
    try:
        raw = _BASE64_SPACE.sub(b"", text.encode("ascii"))
        raw += b"=" * (-len(raw) % 4)  # its padding, which some encoders leave out
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:  # UnicodeEncodeError too: not ASCII
        raise InvalidImage(f"the data URI is not valid base64: {exc}", code="bad_base64") from exc


def too_large(size: int, policy: ImagePolicy) -> InvalidImage:
    return InvalidImage(f"the image has about {size} bytes, more than the limit of "
                        f"{policy.max_bytes}", code="image_too_large")


def decode_bytes(data: bytes, policy: ImagePolicy = DEFAULT) -> Image:
    """``data`` decoded under ``policy``: header checked first, then pixels, then upright."""
    if len(data) > policy.max_bytes:
        raise too_large(len(data), policy)
    pil = require_pillow()
    from PIL import ImageFile, ImageOps

    pil.Image.MAX_IMAGE_PIXELS = policy.max_pixels
    # the fronts decode nothing else: Pillow's bomb warning becomes the error it warns of
    warnings.simplefilter("error", pil.Image.DecompressionBombWarning)
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    image = open_header(data, policy)
    try:
        image.seek(0)
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise InvalidImage(f"the image could not be decoded ({exc}); is it truncated?",
                           code="undecodable_image") from exc
    try:
        ImageOps.exif_transpose(image, in_place=True)  # no second full-size copy
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow's EXIF parser on a client's bytes:
        # SyntaxError, struct.error and others, all of them a malformed block
        raise InvalidImage(f"the image's EXIF data is malformed ({exc}), so which way up it "
                           "is cannot be read", code="undecodable_image") from exc
    return image


def open_header(data: bytes, policy: ImagePolicy) -> Image:
    """The lazily opened image: format and size read from its header, no pixel decoded."""
    from PIL import Image as PilImage

    try:
        image = PilImage.open(io.BytesIO(data), formats=list(policy.formats))
    except (PilImage.DecompressionBombError, PilImage.DecompressionBombWarning) as exc:
        # Pillow's own message names its own limit (twice ours) beside ours: its count only
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        raise bomb(f"{declared.group(1)} pixels" if declared else "its header's size",
                   policy) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidImage("the data is not an image in an accepted format ("
                           + ", ".join(policy.formats) + ")", code="unsupported_image") from exc
    width, height = image.size
    if width * height > policy.max_pixels:
        raise bomb(f"{width} x {height}", policy)
    return image


def bomb(size: str, policy: ImagePolicy) -> InvalidImage:
    return InvalidImage(f"the image declares too many pixels ({size}); the limit is "
                        f"{policy.max_pixels} pixels", code="image_too_many_pixels")


def fetch(url: str, policy: ImagePolicy) -> bytes:
    """The body at ``url`` if the policy allows its host and its addresses, else a 400."""
    if not policy.url_hosts:
        raise InvalidImage("image URLs are not fetched by this server; send a base64 data URI",
                           code="image_url_disabled")
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # a bracket left open, a port out of range or not a number
        raise InvalidImage(f"the image URL is malformed: {exc}", code="image_source") from exc
    if host not in policy.url_hosts:
        raise InvalidImage(f"image URLs are fetched only from {', '.join(policy.url_hosts)}",
                           code="image_url_host")
    address = public_address(host, port)
    # a path or query of other than ASCII, percent-encoded as a browser sends it
    path = quote(parts.path or "/", safe=_URL_SAFE) + (
        f"?{quote(parts.query, safe=_URL_SAFE)}" if parts.query else "")
    named = f"[{host}]" if ":" in host else host  # the Host header: no userinfo in it
    conn = connection(parts.scheme, host, address, port, policy)
    late = threading.Event()
    timer: threading.Timer | None = None
    try:
        conn.connect()
        assert conn.sock is not None
        # one deadline for the whole answer, head and body: a server that sends it a byte
        # at a time (or 100 Continue after 100 Continue) has its connection shut at it
        timer = threading.Timer(policy.read_timeout_s, _cut, (conn.sock, late))
        timer.daemon = True
        timer.start()
        conn.request("GET", path, headers={
            "Host": named if parts.port is None else f"{named}:{port}", "Accept": "image/*"})
        body = read_capped(conn, policy)
        if late.is_set():  # cut as it ended: what came may be short of the whole
            raise http.client.HTTPException("cut at the read timeout")
        return body
    except (OSError, http.client.HTTPException) as exc:
        if late.is_set():
            raise InvalidImage(f"the image URL did not send its image within "
                               f"{policy.read_timeout_s:g}s", code="image_fetch_failed") from exc
        raise InvalidImage(f"the image URL could not be fetched: {exc}",
                           code="image_fetch_failed") from exc
    finally:
        if timer is not None:
            timer.cancel()
        conn.close()


def _cut(sock: socket.socket, late: threading.Event) -> None:
    """The fetch's deadline: the connection shut, so that whatever read waits on it ends."""
    late.set()
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def public_address(host: str, port: int) -> str:
    """The first address ``host`` resolves to, after checking that every one is public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidImage(f"the image host {host} does not resolve",
                           code="image_fetch_failed") from exc
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        if not is_public(ipaddress.ip_address(address.split("%")[0])):
            raise InvalidImage(f"the image host {host} resolves to a non-public address",
                               code="image_url_address")
    return addresses[0]


NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Global and unicast, and so is any IPv4 address an IPv6 one carries (mapped, 6to4,
    NAT64), which would otherwise reach 127.0.0.1 or 10/8 through a translating router."""
    if not ip.is_global or ip.is_multicast:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        return inner is None or is_public(inner)
    return True


def connection(scheme: str, host: str, address: str, port: int,
               policy: ImagePolicy) -> http.client.HTTPConnection:
    """A connection to the checked ``address`` (TLS verified against ``host``)."""
    conn: http.client.HTTPConnection
    if scheme == "https":
        conn = PinnedHTTPS(address, host, port, timeout=policy.connect_timeout_s,
                           context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(address, port, timeout=policy.connect_timeout_s)
    return conn


class PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a fixed address, with the certificate checked for the URL's host name."""

    def __init__(self, address: str, server_name: str, port: int, **kwargs: Any) -> None:
        super().__init__(address, port, **kwargs)
        self.server_name = server_name

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            sock, server_hostname=self.server_name)


def read_capped(conn: http.client.HTTPConnection, policy: ImagePolicy) -> bytes:
    """The body of a 200 response on ``conn``, under the size cap (``fetch`` bounds the
    time)."""
    assert conn.sock is not None
    conn.sock.settimeout(policy.read_timeout_s)
    response = conn.getresponse()
    try:
        if response.status != 200:
            what = "redirects are not followed" if 300 <= response.status < 400 else "not 200"
            raise InvalidImage(f"the image URL answered {response.status} ({what})",
                               code="image_fetch_failed")
        chunks, size = [], 0
        while size <= policy.max_bytes:
            chunk = response.read1(min(_CHUNK, policy.max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > policy.max_bytes:
            raise too_large(size, policy)
        return b"".join(chunks)
    finally:
        response.close()  # conn no longer holds its socket when the server closes
