"""Length-prefixed pickle frames over a stream socket (the engine process's pipe).

A frame is an 8-byte big-endian unsigned length ``n`` followed by ``n`` bytes of pickle
(protocol 5). A stream socket delivers bytes, not messages: one ``recv`` may hold half
a header, several frames, or a piece of a large one. :class:`FrameReader` reassembles
frames from whatever pieces arrive, so the reading side can use non-blocking reads on
an event loop (``loop.add_reader``) and never waits for the rest of a frame; the
blocking helpers :func:`send_frame` / :func:`recv_frame` serve the engine process's
own threads and the start-up handshake.

A length above ``max_frame_bytes`` (default 1 GiB) means the stream is out of sync or
corrupt: :class:`FrameError`, after which the stream cannot be trusted.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

__all__ = [
    "MAX_FRAME_BYTES",
    "FrameError",
    "FrameReader",
    "encode_frame",
    "recv_frame",
    "send_frame",
]

_HEADER = struct.Struct("!Q")
#: the largest frame accepted (a corrupt header would otherwise ask for exabytes)
MAX_FRAME_BYTES = 1 << 30


class FrameError(RuntimeError):
    """The byte stream is not a sequence of valid frames (bad length, or it ended
    inside a frame)."""


def encode_frame(obj: object) -> bytes:
    """``obj`` pickled (protocol 5) behind its 8-byte length."""
    payload = pickle.dumps(obj, protocol=5)
    return _HEADER.pack(len(payload)) + payload


class FrameReader:
    """Reassembles frames from the pieces a stream socket delivers.

    Args:
        max_frame_bytes: a frame longer than this raises :class:`FrameError`.

    State: the bytes received and not yet part of a complete frame.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._need: int | None = None  # payload length of the frame being read
        self.max_frame_bytes = max_frame_bytes

    @property
    def pending_bytes(self) -> int:
        """Bytes held that do not yet make a complete frame (0 between frames)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add received bytes; return the payloads of the frames they complete, in order.

        Raises:
            FrameError: a header announces more than ``max_frame_bytes``.
        """
        self._buf += data
        frames: list[bytes] = []
        buf = self._buf
        while True:
            if self._need is None:
                if len(buf) < _HEADER.size:
                    return frames
                (n,) = _HEADER.unpack_from(buf)
                if n > self.max_frame_bytes:
                    raise FrameError(
                        f"frame length: expected at most {self.max_frame_bytes} bytes, got {n} "
                        "(the stream is out of sync)"
                    )
                del buf[: _HEADER.size]
                self._need = n
            n = self._need
            if len(buf) < n:
                return frames
            frames.append(bytes(buf[:n]))
            del buf[:n]  # cheap: bytearray drops a prefix by moving its start
            self._need = None

    def check_end(self) -> None:
        """The stream ended: raise if it ended inside a frame.

        Raises:
            FrameError: bytes of an incomplete frame are pending.
        """
        if self._need is not None or self._buf:
            got = len(self._buf) + (_HEADER.size if self._need is not None else 0)
            want = f"{self._need + _HEADER.size}" if self._need is not None else "a header"
            raise FrameError(f"stream end: expected a complete frame ({want} bytes), got {got}")


def send_frame(sock: socket.socket, obj: object) -> None:
    """Send ``obj`` as one frame on a blocking socket (``sendall``)."""
    sock.sendall(encode_frame(obj))


def recv_frame(sock: socket.socket, reader: FrameReader, backlog: list[bytes]) -> Any:
    """The next object from a blocking socket.

    ``reader`` and ``backlog`` persist between calls (one ``recv`` can complete several
    frames; the extra ones wait in ``backlog``).

    Raises:
        EOFError: the peer closed the stream between frames.
        FrameError: the stream ended inside a frame, or a bad length.
        OSError, socket.timeout: from ``recv``.
    """
    while not backlog:
        data = sock.recv(1 << 18)
        if not data:
            reader.check_end()
            raise EOFError("stream closed")
        backlog.extend(reader.feed(data))
    return pickle.loads(backlog.pop(0))
