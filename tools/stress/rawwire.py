"""The wire written by hand, for what grpc's generated classes and client refuse to send: protobuf
fields of any number, type and value (varint, tag, field_bytes), and HTTP/2 frames with HPACK headers
for metadata grpc's client refuses (non-ASCII, control characters) (raw_call)."""

from __future__ import annotations

import base64
import socket
import ssl
import struct
import urllib.parse

# --- the protobuf wire format by hand, to send what the generated classes refuse to build ---

U64 = 2**64 - 1


def varint(n: int) -> bytes:
    """Protobuf varint of n; a negative n as its 64-bit two's complement (10 bytes), as int64 sends it."""
    n &= U64
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def field_bytes(number: int, value) -> bytes:
    """int: varint; float: fixed64 double; bytes: length-delimited; list of int: packed varints."""
    if isinstance(value, float):
        return tag(number, 1) + struct.pack("<d", value)
    if isinstance(value, int):
        return tag(number, 0) + varint(value)
    if isinstance(value, list):
        value = b"".join(varint(v) for v in value)
    return tag(number, 2) + varint(len(value)) + value


# --- HTTP/2 by hand, for metadata grpc's client refuses to send (non-ASCII, control characters) ---


def _hpack_int(n: int, prefix: int, flags: int = 0) -> bytes:
    limit = (1 << prefix) - 1
    if n < limit:
        return bytes([flags | n])
    out, n = bytearray([flags | limit]), n - limit
    while n >= 128:
        out.append(n % 128 + 128)
        n //= 128
    return bytes([*out, n])


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header field without indexing, its name and value as they are (no Huffman)."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_decode(block: bytes, table: list) -> list[tuple[bytes, bytes | None]]:
    """The fields of a header block; names from the static table come as b"" and Huffman strings as None
    (gRPC writes grpc-status and grpc-message literally)."""

    def integer(i: int, prefix: int) -> tuple[int, int]:
        limit = (1 << prefix) - 1
        n, i, shift = block[i] & limit, i + 1, 0
        if n < limit:
            return n, i
        while True:
            byte, i = block[i], i + 1
            n, shift = n + ((byte & 127) << shift), shift + 7
            if byte < 128:
                return n, i

    def string(i: int) -> tuple[bytes | None, int]:
        huffman = block[i] & 0x80
        n, i = integer(i, 7)
        return (None if huffman else block[i : i + n]), i + n

    fields, i = [], 0
    while i < len(block):
        first = block[i]
        if first & 0x80:  # indexed
            index, i = integer(i, 7)
            fields.append(table[index - 62] if index > 61 else (b"", b""))
            continue
        if first & 0xE0 == 0x20:  # dynamic table size update
            _, i = integer(i, 5)
            continue
        index, i = integer(i, 6 if first & 0x40 else 4)
        if index == 0:
            name, i = string(i)
        else:
            name = table[index - 62][0] if index > 61 else b""
        value, i = string(i)
        if first & 0x40:  # with incremental indexing
            table.insert(0, (name, value))
        fields.append((name, value))
    return fields


def raw_call(
    address: str, ca: bytes, path: str, headers: list[tuple[bytes, bytes]], body: bytes, timeout: float
):
    """One gRPC call written by hand on HTTP/2 over TLS, so that header values grpc's client refuses
    reach the server: (grpc-status as a number, or what ended the call instead, grpc-message).
    Raises OSError (a socket timeout included) when the connection fails."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cadata=ca.decode())
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout) as plain,
        context.wrap_socket(plain, server_hostname=host) as tls,
    ):
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
        pseudo = [(b":method", b"POST"), (b":scheme", b"https"), (b":path", path.encode())]
        pseudo += [
            (b":authority", address.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        block = b"".join(_hpack_literal(k, v) for k, v in [*pseudo, *headers])
        message = b"\0" + len(body).to_bytes(4, "big") + body
        # HEADERS, then CONTINUATION frames: none past HTTP/2's default frame size (16 KiB)
        pieces = [block[i : i + 16384] for i in range(0, len(block), 16384)]
        frames = [
            _frame(1 if n == 0 else 9, 0x4 if n == len(pieces) - 1 else 0, 1, piece)
            for n, piece in enumerate(pieces)
        ]
        tls.sendall(b"".join(frames) + _frame(0, 0x1, 1, message))
        buffer, table = b"", []
        while True:
            while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
                chunk = tls.recv(65536)
                if not chunk:
                    return "connection closed", ""
                buffer += chunk
            size, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            payload, buffer = buffer[9 : 9 + size], buffer[9 + size :]
            if kind in (4, 6) and not flags & 1:  # SETTINGS, PING: acknowledged
                tls.sendall(_frame(kind, 1, 0, payload if kind == 6 else b""))
            elif kind == 1 and stream == 1:  # HEADERS (one frame: gRPC's are small)
                if flags & 0x8:
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & 0x20:
                    payload = payload[5:]
                fields = dict(_hpack_decode(payload, table))
                if fields.get(b"grpc-status") is not None:
                    details = urllib.parse.unquote((fields.get(b"grpc-message") or b"").decode("latin-1"))
                    return int(fields[b"grpc-status"]), details
            elif kind == 3 and stream == 1:
                return f"RST_STREAM {int.from_bytes(payload[:4], 'big')}", ""
            elif kind == 7:
                return f"GOAWAY {int.from_bytes(payload[4:8], 'big')}", payload[8:].decode("latin-1")


def header_bytes(key: str, value) -> tuple[bytes, bytes]:
    if key.endswith("-bin"):
        return key.encode(), base64.b64encode(value).rstrip(b"=")
    try:
        return key.encode(), value.encode("latin-1")
    except UnicodeEncodeError:
        return key.encode(), value.encode("utf-8", "surrogatepass")
