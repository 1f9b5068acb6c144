"""Length-prefixed frames between the server and the engine process: reassembly from any
split, refusal of a corrupt stream, and the server side's event-loop reader against a
scripted stand-in child (partial frames never block the loop, a large frame arrives in
pieces, a child that dies mid-frame fails every open request, stop without a loop)."""

from __future__ import annotations

import asyncio
import pickle
import random
import socket
import struct
import threading

import pytest

from kvpage.engine.params import CompletionOutput, RequestOutput
from kvpage.server.engine_loop import EngineFailure
from kvpage.server.engine_process import ProcessAsyncEngine
from kvpage.server.framing import (
    FrameError,
    FrameReader,
    encode_frame,
    recv_frame,
    send_frame,
)
from kvpage.server.output_codec import OutputEncoder

# --------------------------------------------------------------------- FrameReader


def test_frames_are_reassembled_from_any_split():
    objs = [("a", 1), {"x": list(range(1000))}, b"", ("big", bytes(3_000_000)), None]
    wire = b"".join(encode_frame(o) for o in objs)
    rng = random.Random(0)
    for trial in range(30):
        r = FrameReader()
        got: list[bytes] = []
        i = 0
        while i < len(wire):
            # single bytes (headers split anywhere), mid-size and huge pieces
            step = rng.choice([1, 3, 7, rng.randint(1, 5000), rng.randint(1, 1_500_000)])
            got.extend(r.feed(wire[i : i + step]))
            i += step
        assert [pickle.loads(p) for p in got] == objs, trial
        assert r.pending_bytes == 0
        r.check_end()  # ended between frames: fine


def test_one_piece_with_many_frames_and_a_tail():
    frames = [encode_frame(i) for i in range(50)]
    r = FrameReader()
    tail = frames[-1][:5]  # half a header
    out = r.feed(b"".join(frames[:-1]) + tail)
    assert [pickle.loads(p) for p in out] == list(range(49))
    assert r.pending_bytes == 5
    assert [pickle.loads(p) for p in r.feed(frames[-1][5:])] == [49]


def test_a_corrupt_length_and_a_truncated_end_are_refused():
    r = FrameReader(max_frame_bytes=1024)
    with pytest.raises(FrameError, match="frame length: expected at most 1024 bytes, got 4096"):
        r.feed(struct.pack("!Q", 4096) + b"x")
    r = FrameReader()
    frame = encode_frame(list(range(100)))
    assert r.feed(frame[:20]) == []
    with pytest.raises(FrameError, match=r"stream end: expected a complete frame \(\d+ bytes\)"):
        r.check_end()
    r = FrameReader()
    r.feed(frame[:3])
    with pytest.raises(FrameError, match="expected a complete frame \\(a header"):
        r.check_end()


def test_blocking_send_and_recv_over_a_socket_pair():
    a, b = socket.socketpair()
    big = ("out", list(range(400_000)))  # several MB: many recv calls
    t = threading.Thread(target=lambda: [send_frame(a, m) for m in (1, big, "end")])
    t.start()
    reader, backlog = FrameReader(), []
    try:
        assert recv_frame(b, reader, backlog) == 1
        assert recv_frame(b, reader, backlog) == big
        assert recv_frame(b, reader, backlog) == "end"
        t.join()
        a.close()
        with pytest.raises(EOFError):
            recv_frame(b, reader, backlog)
    finally:
        a.close()
        b.close()


# ------------------------------------------------- the event-loop reader, scripted child


class _Process:
    """What ProcessAsyncEngine reads of a ``multiprocessing.Process``."""

    def __init__(self) -> None:
        self.alive = True
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        pass


class _Proc:
    """Stands in for EngineProcess: our end of a socket pair, no real child."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.backlog: list[bytes] = []
        self.process = _Process()

    def get_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.sock.close()


class _Child:
    """The child's end: answers commands ("res" for add/abort/call) from a thread, and
    lets the test write raw bytes."""

    def __init__(self, sock: socket.socket, final: dict | None = None) -> None:
        self.sock = sock
        self.final = final
        self.commands: list[tuple] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        reader, backlog = FrameReader(), []
        while True:
            try:
                msg = recv_frame(self.sock, reader, backlog)
            except (EOFError, OSError, FrameError):
                return
            self.commands.append(msg)
            if msg[0] == "stop":
                with self.lock:
                    send_frame(self.sock, ("final", self.final))
                self.sock.close()
                return
            if msg[1] is not None:
                with self.lock:
                    send_frame(self.sock, ("res", msg[1], True, None))

    def write(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)


def _out_frame(rid: str, prompt_len: int, tokens: list[int], finished: bool) -> bytes:
    out = RequestOutput(
        rid,
        None,
        list(range(prompt_len)),
        0,
        [CompletionOutput(0, tokens, finish_reason="length" if finished else None)],
        finished,
        0.0,
    )
    return encode_frame(("out", [(rid, OutputEncoder().encode(out))], None))


def _pair() -> tuple[ProcessAsyncEngine, _Proc, socket.socket]:
    ours, theirs = socket.socketpair()
    proc = _Proc(ours)
    return ProcessAsyncEngine(proc), proc, theirs  # type: ignore[arg-type]


def test_a_large_frame_in_pieces_never_blocks_the_loop():
    eng, _proc, theirs = _pair()
    child = _Child(theirs)

    async def main() -> None:
        eng.start(asyncio.get_running_loop())
        q = await eng.add("r1", [1, 2, 3], None)
        frame = _out_frame("r1", 1_000_000, [7, 8], finished=True)  # ~5 MB of pickle
        assert len(frame) > 1 << 22
        cut = [0, 5, len(frame) // 3, 2 * len(frame) // 3, len(frame)]
        for i in range(len(cut) - 1):
            # written from another thread: a piece larger than the socket buffer
            # completes only while the loop reads
            await asyncio.to_thread(child.write, frame[cut[i] : cut[i + 1]])
            if i < len(cut) - 2:
                # the loop runs this coroutine again while the frame is incomplete:
                # nothing waits for the rest of it
                for _ in range(5):
                    await asyncio.sleep(0.01)
                assert q.empty()
        out = await asyncio.wait_for(q.get(), 30)
        assert out.finished and out.outputs[0].token_ids == [7, 8]
        assert len(out.prompt_token_ids) == 1_000_000
        assert eng._reader.pending_bytes == 0

    try:
        asyncio.run(main())
    finally:
        eng._stopped = True
        theirs.close()
        _proc.close()


def test_a_child_dying_mid_frame_fails_every_open_request():
    eng, proc, theirs = _pair()
    child = _Child(theirs)

    async def main() -> None:
        eng.start(asyncio.get_running_loop())
        qa = await eng.add("a", [1], None)
        qb = await eng.add("b", [2], None)
        frame = _out_frame("a", 10, [5], finished=False)
        await asyncio.to_thread(child.write, frame[: len(frame) // 2])  # then it dies
        proc.process.alive, proc.process.exitcode = False, -9
        theirs.shutdown(socket.SHUT_RDWR)  # as the kernel does for a dead process
        theirs.close()
        for q in (qa, qb):
            item = await asyncio.wait_for(q.get(), 30)
            assert isinstance(item, EngineFailure)
            assert str(item) == "engine process exited (code -9)"
        assert not eng.running
        with pytest.raises(RuntimeError, match="expected a running"):
            await eng.add("c", [3], None)

    asyncio.run(main())
    assert child.commands[0][0] == "add"
    proc.close()


def test_stop_without_a_running_loop_reads_the_final_report():
    eng, proc, theirs = _pair()
    _Child(theirs, final={"metrics": {"m": 1.0}, "integrity": "ok"})
    loop = asyncio.new_event_loop()
    try:

        async def add() -> asyncio.Queue:
            eng.start(asyncio.get_running_loop())
            return await eng.add("a", [1], None)

        q = loop.run_until_complete(add())
        eng.stop(timeout_s=10)  # the loop is not running now: the blocking path
        assert eng.final_report == {"metrics": {"m": 1.0}, "integrity": "ok"}
        assert eng.metrics_snapshot == {"m": 1.0}
        item = q.get_nowait()
        assert isinstance(item, EngineFailure) and "stopped" in str(item)
    finally:
        loop.close()
        proc.close()


def test_a_command_larger_than_the_socket_buffer_is_written_without_blocking():
    eng, proc, theirs = _pair()
    child = _Child(theirs)
    prompt = list(range(2_000_000))  # ~10 MB frame: the socket takes it in pieces

    async def main() -> None:
        eng.start(asyncio.get_running_loop())
        task = asyncio.ensure_future(eng.add("big", prompt, None))
        await asyncio.sleep(0)  # the add ran up to its send, and the loop has us back
        assert len(eng._wbuf) > 0  # the socket took a part; the rest waits for add_writer
        await asyncio.wait_for(task, 60)
        assert not eng._wbuf  # all of it was sent

    try:
        asyncio.run(main())
        assert child.commands[0][0] == "add" and child.commands[0][3].prompt == prompt
    finally:
        eng._stopped = True
        theirs.close()
        proc.close()
