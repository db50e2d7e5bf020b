"""Safe image decoding: every hostile input a typed 400, good ones decoded upright."""

from __future__ import annotations

import base64
import contextlib
import io
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageFile  # noqa: E402

from embedsvc.errors import InvalidRequest  # noqa: E402
from embedsvc.image import decode  # noqa: E402
from embedsvc.image.decode import ImagePolicy, InvalidImage, decode_image  # noqa: E402


def encode(image: Image.Image, fmt: str = "PNG", **kwargs: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def refused(source: str, code: str, policy: ImagePolicy = decode.DEFAULT) -> InvalidImage:
    with pytest.raises(InvalidImage) as info:
        decode_image(source, policy, param="images[0]")
    assert info.value.code == code, info.value.message
    assert isinstance(info.value, InvalidRequest) and info.value.status == 400
    assert info.value.param == "images[0]"
    return info.value


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares ``width`` x ``height``: a decompression bomb."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_each_listed_format_decodes(fmt):
    image = decode_image(uri(encode(Image.new("RGB", (31, 17), (200, 10, 10)), fmt)))
    assert image.size == (31, 17)


def test_a_decompression_bomb_is_refused_before_any_pixel(monkeypatch):
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(1))
    err = refused(uri(png_declaring(50_000, 50_000)), "image_too_many_pixels")
    assert "2500000000 pixels" in err.message and loads == []
    # one limit named, the policy's: Pillow's own message quoted its doubled one beside it
    assert "80000000" not in err.message and "limit is 40000000 pixels" in err.message


def test_a_bomb_under_twice_the_limit_is_refused_too():
    """Pillow only warns between the limit and twice it; the warning must not let it pass."""
    err = refused(uri(png_declaring(7000, 7000)), "image_too_many_pixels")
    assert "49000000 pixels" in err.message


def test_pillows_own_limit_is_set_to_the_policys(monkeypatch):
    # Pillow's limit is the process's: put back for the tests that run after this one
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    decode_image(uri(encode(Image.new("RGB", (4, 4)))), ImagePolicy(max_pixels=1234))
    assert Image.MAX_IMAGE_PIXELS == 1234


def test_a_truncated_jpeg_is_refused():
    data = encode(Image.effect_noise((256, 256), 60).convert("RGB"), "JPEG")
    refused(uri(data[: len(data) // 2], "image/jpeg"), "undecodable_image")


def test_an_svg_is_refused():
    svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>'
    refused(uri(svg, "image/svg+xml"), "unsupported_image")


def test_a_format_off_the_list_is_refused():
    refused(uri(encode(Image.new("RGB", (8, 8)), "TIFF")), "unsupported_image")


def test_a_20_mb_base64_string_is_refused_before_decoding_base64(monkeypatch):
    monkeypatch.setattr(base64, "b64decode", lambda *a, **k: pytest.fail("decoded"))
    refused("data:image/png;base64," + "A" * 20_000_000, "image_too_large")


@pytest.mark.parametrize("source, code", [
    ("data:image/png;base64,@@@@", "bad_base64"),
    ("data:image/png,plain", "image_source"),
    ("/etc/passwd", "image_source"),
    ("file:///etc/passwd", "image_source"),
])
def test_malformed_sources_are_refused(source, code):
    refused(source, code)


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 10), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 10, 10))  # the white square at the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 clockwise to view
    upright = decode_image(uri(encode(image, "JPEG", exif=exif.tobytes()), "image/jpeg"))
    assert upright.size == (10, 40)
    assert upright.getpixel((5, 5))[0] > 200  # the left edge turned to the top


def test_malformed_exif_is_a_400_not_a_500():
    """A broken TIFF header in the EXIF block: exif_transpose raised SyntaxError outside
    the decoder's guard, a 500 with a traceback."""
    image = Image.new("RGB", (24, 18), (200, 30, 40))
    exif = image.getexif()
    exif[0x0112] = 6
    webp = encode(image, "WEBP", exif=exif.tobytes())
    bad = webp.replace(b"MM\x00*", b"XX\x00*", 1).replace(b"II*\x00", b"XX*\x00", 1)
    assert bad != webp
    refused(uri(bad, "image/webp"), "undecodable_image")
    png = encode(image)  # an eXIf chunk, its CRC right, its TIFF header not
    body = b"XX\x00*\x00\x00\x00\x08\x00\x00"
    exif_chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(
        ">I", zlib.crc32(b"eXIf" + body))
    end = png.rfind(b"IEND") - 4
    refused(uri(png[:end] + exif_chunk + png[end:]), "undecodable_image")


def test_a_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (6, 6), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(uri(buf.getvalue())).convert("RGB").getpixel((0, 0)) == (255, 0, 0)


def test_a_url_is_refused_when_fetching_is_off():
    refused("https://images.example.com/cat.png", "image_url_disabled")
    refused("http://[", "image_url_disabled")  # not parsed at all while fetching is off


@pytest.mark.parametrize("url", ["http://[", "https://[::1/x.png", "http://a]b/",
                                 "http://images.test:99999/x.png",
                                 "http://images.test:abc/x.png"])
def test_a_malformed_url_is_a_400_not_a_500(url):
    """urlsplit and its port raise ValueError on these: a 500 with a traceback, it was."""
    refused(url, "image_source", ImagePolicy(url_hosts=("images.test",)))


def test_base64_without_its_padding_is_read():
    padded = [base64.b64encode(encode(Image.new("RGB", (w, 3)))).decode() for w in range(1, 9)]
    data = next(d for d in padded if d.endswith("="))  # a PNG whose length needs padding
    assert decode_image("data:image/png;base64," + data.rstrip("=")).size[1] == 3
    whole = next(d for d in padded if not d.endswith("="))
    refused("data:image/png;base64," + whole + "A", "bad_base64")  # no padding makes it whole


def test_schemes_are_read_whatever_their_case():
    assert decode_image("DATA:image/png;base64," + base64.b64encode(
        encode(Image.new("RGB", (3, 3)))).decode()).size == (3, 3)
    refused("HTTPS://images.example.com/cat.png", "image_url_disabled")


def test_a_host_off_the_list_is_refused():
    refused("https://evil.example.net/cat.png", "image_url_host",
            ImagePolicy(url_hosts=("images.example.com",)))


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "::1",
                                     "192.168.0.7", "fd00::1", "0.0.0.0", "100.64.0.1",
                                     "::ffff:127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::",
                                     "224.0.0.1"])
def test_a_listed_host_resolving_to_a_private_address_is_refused(monkeypatch, address):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", 443)),
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, 443))])
    refused("https://images.example.com/cat.png", "image_url_address",
            ImagePolicy(url_hosts=("images.example.com",)))


def test_a_url_to_loopback_is_refused_with_fetching_enabled():
    refused("http://127.0.0.1:9/cat.png", "image_url_address",
            ImagePolicy(url_hosts=("127.0.0.1",)))


class Handler(BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(self.status)
        if self.status == 302:
            self.send_header("Location", "http://127.0.0.1/elsewhere.png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(monkeypatch) -> Iterator[tuple[str, type[Handler]]]:
    """A loopback server the fetch may reach: its address passes as public in this test only."""
    handler = type("H", (Handler,), {})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    monkeypatch.setattr(decode, "public_address", lambda host, port: "127.0.0.1")
    yield f"http://images.test:{port}/cat.png", handler
    httpd.shutdown()


def answering_slowly(handler: type[Handler], body: bytes, *, first_s: float = 0.0,
                     each_byte_s: float = 0.0) -> None:
    """``handler`` answers ``body`` after ``first_s``, a byte every ``each_byte_s``."""
    def slowly(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        time.sleep(first_s)
        with contextlib.suppress(OSError):  # the fetch gave up, as it should
            for i in range(0, len(body), 1 if each_byte_s else len(body)):
                self.wfile.write(body[i:i + 1] if each_byte_s else body)
                self.wfile.flush()
                time.sleep(each_byte_s)

    handler.do_GET = slowly  # type: ignore[method-assign]


def recording(handler: type[Handler], what) -> list:
    """What ``what`` reads of each request ``handler`` answers, as it answers them."""
    seen: list = []
    answer = handler.do_GET

    def record(self) -> None:
        seen.append(what(self))
        answer(self)

    handler.do_GET = record  # type: ignore[method-assign]
    return seen


FETCHING = ImagePolicy(url_hosts=("images.test",), max_bytes=5000)


def test_a_public_address_passes():
    assert decode.is_public(decode.ipaddress.ip_address("93.184.216.34"))
    assert decode.is_public(decode.ipaddress.ip_address("2606:2800:220:1::1"))


def test_a_listed_url_is_fetched(server):
    url, handler = server
    handler.body = encode(Image.new("RGB", (9, 9)))
    assert decode_image(url, FETCHING).size == (9, 9)


def test_a_redirect_is_not_followed(server):
    url, handler = server
    handler.status = 302
    refused(url, "image_fetch_failed", FETCHING)


def test_a_body_over_the_cap_is_refused(server):
    url, handler = server
    handler.body = b"x" * 6000
    refused(url, "image_too_large", FETCHING)


def test_a_server_that_sends_its_body_slowly_is_cut_off_at_the_read_timeout(server):
    """The read timeout bounds the whole body: a byte every 50 ms (each read well inside
    the timeout) held the request thread for as long as the server cared to send."""
    url, handler = server
    answering_slowly(handler, encode(Image.new("RGB", (9, 9))), each_byte_s=0.05)
    started = time.monotonic()
    refused(url, "image_fetch_failed", ImagePolicy(url_hosts=("images.test",),
                                                   read_timeout_s=0.5))
    assert time.monotonic() - started < 2


def test_a_server_that_sends_its_head_slowly_is_cut_off_at_the_read_timeout(monkeypatch):
    """The read timeout bounds the whole answer, head included: a status line and headers
    a byte at a time (each read inside the timeout) held the request for as long as the
    server cared to send them."""
    monkeypatch.setattr(decode, "public_address", lambda host, port: "127.0.0.1")
    listener = socket.create_server(("127.0.0.1", 0))

    def slowly() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 200:
                conn.sendall(bytes([byte]))
                time.sleep(0.02)

    threading.Thread(target=slowly, daemon=True).start()
    started = time.monotonic()
    with listener:
        err = refused(f"http://images.test:{listener.getsockname()[1]}/cat.png",
                      "image_fetch_failed", ImagePolicy(url_hosts=("images.test",),
                                                        read_timeout_s=0.5))
    assert time.monotonic() - started < 2 and "within 0.5s" in err.message


def test_a_path_of_other_than_ascii_is_fetched_percent_encoded(server):
    """http.client refused it with UnicodeEncodeError, past the fetch's guard: a 500."""
    url, handler = server
    handler.body = encode(Image.new("RGB", (9, 9)))
    paths = recording(handler, lambda request: request.path)
    assert decode_image(url.replace("cat.png", "café.png?q=ü"), FETCHING).size == (9, 9)
    assert paths == ["/caf%C3%A9.png?q=%C3%BC"]


def test_a_slow_url_holds_no_decode_slot_meanwhile(server, monkeypatch):
    """A URL is fetched outside the process's decode slots: one slow server held a slot
    for its whole fetch, and every image behind it waited, data URIs included."""
    import types

    from prometheus_client import CollectorRegistry

    from embedsvc.engine_client import EngineClient
    from embedsvc.image.preprocess import Preprocessor
    from embedsvc.metrics import Metrics

    url, handler = server
    png = encode(Image.new("RGB", (9, 9)))
    answering_slowly(handler, png, first_s=1.5)
    monkeypatch.setattr(decode, "_SLOTS", threading.BoundedSemaphore(1))
    client = types.SimpleNamespace(metrics=Metrics(CollectorRegistry()),
                                   info=types.SimpleNamespace(image_tokens=1),
                                   _image_side=lambda: (FETCHING, Preprocessor()))
    fetching = threading.Thread(target=EngineClient.images, args=(
        client, [types.SimpleNamespace(source=url, param="input", where="")]),
        kwargs={"deadline": time.monotonic() + 30})
    fetching.start()
    time.sleep(0.3)  # the fetch under way
    started = time.monotonic()
    (pixels,) = EngineClient.images(client, [types.SimpleNamespace(
        source=uri(png), param="input", where="")], deadline=time.monotonic() + 30)
    assert time.monotonic() - started < 0.8  # not behind the fetch's 1.5 s
    fetching.join(10)


def test_the_host_header_names_the_host_and_port_and_no_credentials(server):
    url, handler = server
    handler.body = encode(Image.new("RGB", (9, 9)))
    seen = recording(handler, lambda request: request.headers["Host"])
    decode_image(url.replace("http://", "http://user:secret@"), FETCHING)
    assert seen == [url.split("/")[2]]  # images.test:PORT


def test_without_pillow_one_line_names_the_extra(monkeypatch):
    from embedsvc.image import require_pillow

    monkeypatch.setitem(__import__("sys").modules, "PIL.Image", None)
    with pytest.raises(ImportError) as info:
        require_pillow()
    assert str(info.value) == "images need Pillow: pip install 'embedsvc[image]'"


def test_decodes_at_once_are_bounded_and_a_waiting_request_still_ends(monkeypatch):
    """One image decoded at a time per CPU in a process: each can hold some 350 MiB of
    full-size copies, and 16 request threads decoding at once held gigabytes. A request
    that waits for a slot still ends at its deadline (``still_wanted`` raises)."""
    slots = threading.BoundedSemaphore(1)
    monkeypatch.setattr(decode, "_SLOTS", slots)
    monkeypatch.setattr(decode, "_WATCH_S", 0.05)
    looks = []

    def late() -> None:
        looks.append(1)
        if len(looks) >= 2:
            raise InvalidRequest("past its deadline")

    # the one slot held, a second decode waits, and its request ends meanwhile
    with decode.decoding(late), pytest.raises(InvalidRequest), decode.decoding(late):
        pytest.fail("a second decode ran beside the first")
    assert len(looks) == 2
    with pytest.raises(ValueError), decode.decoding(late):  # a failed decode frees its slot
        raise ValueError("undecodable")
    assert slots.acquire(blocking=False)
