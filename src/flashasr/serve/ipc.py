"""Length-prefixed binary framing between front-end workers and the engine process.

Every message is one frame on a persistent Unix-domain stream socket::

    header (28 bytes, little-endian, struct "<2sBBHHQIQ")
      magic        2s   b"FA"
      version      u8   2
      type         u8   MsgType
      flags        u16  Flag bits (SHM, PCM16, SHM_POOLED)
      reserved     u16  0
      request_id   u64  chosen by the sender of a request; replies carry the same id
      meta_len     u32  bytes of compact UTF-8 JSON metadata that follow (<= 64 MiB)
      payload_len  u64  bytes of raw payload that follow the metadata
    meta     (meta_len bytes)     e.g. {"options": {"language": "en", ...}, "priority": 2, "n": 160000}
    payload  (payload_len bytes)  raw little-endian float32 (or int16 with PCM16) samples

Audio is never JSON-encoded or pickled. A payload above the shared-memory threshold
travels through :mod:`multiprocessing.shared_memory`: the frame carries ``SHM`` in its
flags, an empty payload, and ``{"shm": NAME, "n": samples}`` in its metadata. Normally the
segment comes from the sender's :class:`ShmPool` (flag ``SHM_POOLED``): the receiver maps it
once, reads the samples in place, and the sender reuses it after the reply. Otherwise
(pool full) it is a one-off segment that the receiver copies out and unlinks at once.

Messages:

==============  ===================  ==============================================================
type            direction            metadata
==============  ===================  ==============================================================
``HELLO``       engine -> front end  on connect: ``model``, ``family``, ``pid``, ``device``,
                                     ``capabilities`` (:class:`~flashasr.options.ModelCapabilities`),
                                     ``engine_restarts`` (the supervisor's count before this engine)
``TRANSCRIBE``  front end -> engine  ``options`` (:class:`~flashasr.options.TranscribeOptions` as a
                                     dict), ``priority``, optional ``key`` (a stream's partials
                                     coalesce), optional ``pieces`` ``[[start, end], ...]`` (an
                                     upload's pieces; the audio crosses once) and ``speech`` (per
                                     piece its VAD spans ``[[a, b], ...]`` or null), the audio fields
``RESULT``      engine -> front end  ``transcripts``: one per piece (one without ``pieces``; with
                                     language probabilities and warnings), or
                                     ``{"superseded": true}`` for a replaced partial
``ERROR``       engine -> front end  ``{"code", "message", "status", "param"}``
``CANCEL``      front end -> engine  the client went away: drop the request's work
``STREAM_CLOSE`` front end -> engine ``{"stream": key}``: drop a chunked stream's state (no reply);
                                     a TRANSCRIBE with ``"stream": key`` (and ``"new": true`` on
                                     its first; ``options`` on the first, which the engine keeps
                                     for the stream's later chunks on that connection) is that
                                     stream's new audio; its RESULT is ``{"stream_result": {...}}``
                                     (a StreamResult)
``STATS``       both ways            ``STATS_REPLY``: the engine's Prometheus text as payload
``PING``        both ways            ``PONG``
==============  ===================  ==============================================================
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import json
import logging
import socket
import struct
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from ..options import TranscribeOptions
from ..shm import create_segment, open_segment, unlink_segment
from ..types import Segment, StreamResult, Transcript, Word
from .errors import SHUTTING_DOWN, APIError, EngineUnavailable

log = logging.getLogger("flashasr.serve")

MAGIC = b"FA"
VERSION = 2  # 2: options object, pieces, a list of transcripts per RESULT
HEADER = struct.Struct("<2sBBHHQIQ")
HEADER_SIZE = HEADER.size  # 28
MAX_META = 64 << 20  # a 4-hour transcript with word times is a few MB of JSON
MAX_PAYLOAD = 1 << 34  # 16 GiB: far above any accepted upload


class MsgType(enum.IntEnum):
    HELLO = 1
    TRANSCRIBE = 2
    RESULT = 3
    ERROR = 4
    CANCEL = 5
    STATS = 6
    STATS_REPLY = 7
    PING = 8
    PONG = 9
    STREAM_CLOSE = 10


class Flag(enum.IntFlag):
    NONE = 0
    SHM = 1      # payload is in shared memory named by meta["shm"]
    PCM16 = 2    # samples are int16 (else float32)
    SHM_POOLED = 4  # the segment is the sender's pooled one: read in place, keep mapped, never unlink


class FramingError(Exception):
    """A frame violated the wire format (bad magic/version/type or lengths over the limits)."""


@dataclass
class Frame:
    type: int
    req_id: int
    flags: int
    meta: dict
    payload: bytes | bytearray | memoryview


def _json_codec():
    """``(encode, scan)``: compact JSON text of a metadata object, and the C scanner of ``json.loads``
    (``scan(text, 0) -> (object, end)``). ``JSONEncoder.encode`` builds its C encoder anew on every
    call and ``json.loads`` checks its argument and skips whitespace with two regular expressions:
    2-3 us of a frame's few (``bench_engine_chunks.py``). Where this Python's ``json`` has no C
    encoder of the expected signature, its own ``encode``."""
    enc = json.JSONEncoder(separators=(",", ":"), check_circular=False)
    scan = json.JSONDecoder().scan_once
    try:
        from json.encoder import c_make_encoder, encode_basestring_ascii

        c = c_make_encoder(None, enc.default, encode_basestring_ascii, None, ":", ",", False, False, True)
        if "".join(c({"a": [1, 2.5, "\u00e9", None]}, 0)) != enc.encode({"a": [1, 2.5, "\u00e9", None]}):
            raise TypeError("not json's own encoding")
        return (lambda o: "".join(c(o, 0))), scan
    except (ImportError, TypeError):
        return enc.encode, scan


_JSON_ENCODE, _JSON_SCAN = _json_codec()
_MSG_TYPES = frozenset(int(t) for t in MsgType)
_SHM, _PCM16, _SHM_POOLED = int(Flag.SHM), int(Flag.PCM16), int(Flag.SHM_POOLED)  # plain ints: IntFlag's & is slow


def encode(mtype: int, req_id: int, meta: dict | None = None, payload=b"", flags: int = 0) -> list:
    """Return the frame as a list of buffers for ``writer.writelines`` (payload is not copied)."""
    m = _JSON_ENCODE(meta).encode() if meta else b""
    plen = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    return [HEADER.pack(MAGIC, VERSION, int(mtype), int(flags), 0, req_id, len(m), plen) + m, payload]


def parse_header(b: bytes) -> tuple[int, int, int, int, int]:
    """Validate a 28-byte header; returns (type, flags, req_id, meta_len, payload_len)."""
    return _check_header(HEADER.unpack(b))


def _check_header(fields: tuple) -> tuple[int, int, int, int, int]:
    magic, ver, mtype, flags, _r, req_id, mlen, plen = fields
    if magic != MAGIC:
        raise FramingError(f"bad magic {magic!r}")
    if ver != VERSION:
        raise FramingError(f"unsupported framing version {ver}")
    if mtype not in _MSG_TYPES:
        raise FramingError(f"unknown message type {mtype}")
    if mlen > MAX_META or plen > MAX_PAYLOAD:
        raise FramingError(f"frame too large (meta {mlen} B, payload {plen} B)")
    return mtype, flags, req_id, mlen, plen


def _meta(buf, start: int, mlen: int) -> dict:
    """A frame's metadata: the JSON object in ``buf[start:start + mlen]``."""
    try:
        text = buf[start:start + mlen].decode()
        try:  # what encode() writes: one JSON value, no whitespace around it
            meta, end = _JSON_SCAN(text, 0)
        except (StopIteration, ValueError):
            end = -1
        if end != len(text):  # anything else: json.loads accepts it or says why not
            meta = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise FramingError(f"metadata is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise FramingError("metadata must be a JSON object")
    return meta


WRITE_HIGH = 4 << 20  # queued bytes above which Conn.send waits for the socket to drain ...
WRITE_LOW = 1 << 20   # ... down to this
IOV_MAX = 1024        # buffers per sendmsg (Linux's limit)


class Conn:
    """One end of a framed Unix-socket connection on the running event loop.

    Reads, in one of two ways: :meth:`recv_frame` awaits one frame (``loop.sock_recv_into``); or
    :meth:`read_frames` hands every frame to a callback as it arrives, from a reader that stays
    registered with the event loop (the engine's way: no task, future or poll set-up per frame). A
    payload not yet read ahead lands directly in its own numpy array (one kernel copy, no
    intermediate stream buffer). Writes go out in order, whole: the
    frames queued during one turn of the event loop leave together in one ``sendmsg`` at its end
    (no task, future or lock per frame); what the socket does not take goes out from one writer
    task, so a caller cancelled meanwhile never cuts a frame in half (:meth:`send`).
    :meth:`close` shuts the socket down at once, so a receive or send in progress ends (end of
    stream, broken pipe) instead of waiting on a peer; the descriptor itself closes when the last
    of them has returned (closed under the event loop's feet, asyncio logs ``Bad file descriptor``).
    """

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._wq: collections.deque = collections.deque()  # unsent buffers (memoryviews), in order
        self._wbytes = 0
        self._flushing = False  # a flush is scheduled or the writer task runs
        self._writer: asyncio.Task | None = None
        self._drain: list[asyncio.Future] = []  # senders waiting for the queue to drain
        self._werr: BaseException | None = None  # why the connection broke (no more sends)
        self.closed = False
        self._buf = bytearray(1 << 18)  # read-ahead: many small frames per recv call
        self._start = self._end = 0
        self._ops = 0  # receives and sends in progress on the socket
        self._on_frame = None  # read_frames(): the callback, the future that ends with the reading, ...
        self._rdone: asyncio.Future | None = None
        self._reader = False  # ... whether its reader is registered with the loop,
        self._rpaused = False  # ... held until the write queue drains (hold_reading_until_drained),
        self._part: tuple | None = None  # ... a frame whose payload is still arriving: (frame, its bytes so far)

    @classmethod
    async def connect(cls, path: str) -> "Conn":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(s, path)
        except BaseException:
            s.close()
            raise
        return cls(s)

    async def _recv_into(self, view: memoryview) -> None:
        while len(view):
            n = await self.loop.sock_recv_into(self.sock, view)
            if n == 0:
                raise asyncio.IncompleteReadError(b"", len(view))
            view = view[n:]

    async def _fill(self, need: int) -> None:
        """Make at least ``need`` bytes available in the read-ahead buffer."""
        if self._end - self._start >= need:
            return
        if self._start + need > len(self._buf):  # compact (and grow for a large header/meta)
            data = self._buf[self._start:self._end]
            if need > len(self._buf):
                self._buf = bytearray(need)
            self._buf[:len(data)] = data
            self._start, self._end = 0, len(data)
        mv = memoryview(self._buf)
        while self._end - self._start < need:
            n = await self.loop.sock_recv_into(self.sock, mv[self._end:])
            if n == 0:
                raise asyncio.IncompleteReadError(b"", need)
            self._end += n

    async def recv_frame(self) -> Frame:
        """Read one frame; the payload is a writable numpy uint8 array (empty bytes when none).

        Header and metadata come from the read-ahead buffer; a payload is copied from what was
        already read ahead and the rest is received straight into its own array.
        """
        if self.closed:
            raise ConnectionError("connection closed")
        self._ops += 1
        try:
            return await self._recv_frame()
        finally:
            self._op_done()

    async def _recv_frame(self) -> Frame:
        if self._end - self._start < HEADER_SIZE:  # (no coroutine when the bytes are already here)
            await self._fill(HEADER_SIZE)
        mtype, flags, req_id, mlen, plen = _check_header(HEADER.unpack_from(self._buf, self._start))
        self._start += HEADER_SIZE
        meta = {}
        if mlen:
            if self._end - self._start < mlen:
                await self._fill(mlen)
            meta = _meta(self._buf, self._start, mlen)
            self._start += mlen
        payload = b""
        if plen:
            payload = np.empty(plen, np.uint8)
            have = min(plen, self._end - self._start)
            if have:
                payload[:have] = np.frombuffer(self._buf, np.uint8, have, self._start)
                self._start += have
            if have < plen:
                await self._recv_into(memoryview(payload)[have:])
        if self._start == self._end:
            self._start = self._end = 0
        return Frame(mtype, req_id, flags, meta, payload)

    def read_frames(self, on_frame) -> asyncio.Future:
        """Hand every frame to ``on_frame(frame)`` as it arrives (frames as :meth:`recv_frame` returns
        them, in order), called from a reader that stays registered with the event loop: no task,
        future, coroutine or poll set-up per frame (``loop.sock_recv_into`` registers the socket
        with the loop and removes it again for every receive: about ten system calls). Frames
        already read ahead by :meth:`recv_frame` come first. Returns a future that ends with the
        reading: its exception says why (``asyncio.IncompleteReadError`` at the end of the stream,
        :class:`FramingError`, ``OSError``, or what ``on_frame`` raised), ``ConnectionError`` when
        the connection is closed. Use one way of reading per connection at a time."""
        if self.closed:
            raise ConnectionError("connection closed")
        self._on_frame = on_frame
        self._rdone = self.loop.create_future()
        self._resume_reading()
        return self._rdone

    def hold_reading_until_drained(self) -> None:
        """:meth:`read_frames`: stop reading while more than :data:`WRITE_HIGH` bytes wait to be sent
        (a peer that does not read its replies), until they are down to :data:`WRITE_LOW`, as a
        reader that awaits :meth:`send` after each frame would; nothing while fewer wait."""
        if self._wbytes > WRITE_HIGH and self._rdone is not None and not self._rdone.done():
            self._rpaused = True
            self._unregister_reader()

    def _resume_reading(self) -> None:
        self._rpaused = False
        if self.closed or self._rdone is None or self._rdone.done():
            return
        try:
            self._parse_frames()  # what was read ahead before (recv_frame, or before a hold)
        except BaseException as e:  # noqa: BLE001 - the reading's end, whatever ended it
            self._end_reading(e)
            return
        if not (self._rpaused or self.closed or self._rdone.done() or self._reader):
            self.loop.add_reader(self.sock, self._on_readable)
            self._reader = True

    def _unregister_reader(self) -> None:
        if self._reader:
            self._reader = False
            self.loop.remove_reader(self.sock)

    def _end_reading(self, err: BaseException) -> None:
        self._unregister_reader()
        if self._rdone is not None and not self._rdone.done():
            self._rdone.set_exception(err)

    def _on_readable(self) -> None:
        """The reader: one receive (a payload's rest straight into its array, else into the
        read-ahead buffer), then every whole frame to the callback."""
        try:
            part = self._part
            if part is not None:
                frame, got = part
                n = self.sock.recv_into(memoryview(frame.payload)[got:])
                if n == 0:
                    raise asyncio.IncompleteReadError(b"", len(frame.payload) - got)
                if got + n < len(frame.payload):
                    self._part = (frame, got + n)
                    return
                self._part = None
                self._on_frame(frame)
            else:
                if self._start:  # what is left is part of one frame's header and metadata: to the front
                    rest = self._end - self._start
                    self._buf[:rest] = self._buf[self._start:self._end]
                    self._start, self._end = 0, rest
                n = self.sock.recv_into(memoryview(self._buf)[self._end:])
                if n == 0:
                    raise asyncio.IncompleteReadError(b"", HEADER_SIZE)
                self._end += n
            self._parse_frames()
        except (BlockingIOError, InterruptedError):
            return
        except BaseException as e:  # noqa: BLE001 - the reading's end, whatever ended it
            self._end_reading(e)

    def _parse_frames(self) -> None:
        """Every whole frame in the read-ahead buffer to the callback; a payload only partly read
        ahead becomes :attr:`_part` (its rest is received into its own array)."""
        buf, on_frame = self._buf, self._on_frame
        while not (self._rpaused or self.closed or self._rdone.done() or self._part is not None):
            start, avail = self._start, self._end - self._start
            if avail < HEADER_SIZE:
                break
            mtype, flags, req_id, mlen, plen = _check_header(HEADER.unpack_from(buf, start))
            if avail < HEADER_SIZE + mlen:
                if HEADER_SIZE + mlen > len(buf):  # a large metadata: a buffer that holds it
                    big = bytearray(HEADER_SIZE + mlen)
                    big[:avail] = buf[start:self._end]
                    self._buf, self._start, self._end = big, 0, avail
                break
            meta = _meta(buf, start + HEADER_SIZE, mlen) if mlen else {}
            p0 = start + HEADER_SIZE + mlen
            payload = b""
            if plen:
                have = min(plen, self._end - p0)
                if have == plen:
                    payload = np.frombuffer(buf, np.uint8, plen, p0).copy()
                else:
                    payload = np.empty(plen, np.uint8)
                    payload[:have] = np.frombuffer(buf, np.uint8, have, p0)
                p0 += have
            self._start = p0
            if self._start == self._end:
                self._start = self._end = 0
            frame = Frame(mtype, req_id, flags, meta, payload)
            if plen and have < plen:
                self._part = (frame, have)
                break
            on_frame(frame)

    async def send(self, parts: list) -> None:
        """Queue one encoded frame (:func:`encode`) for sending; frames leave whole and in the order
        of the calls. The frames queued in one turn of the event loop go out together in one
        ``sendmsg`` at its end (no task, future or lock per frame; one system call for a step's
        replies); what the socket does not take then goes out from one writer task. Returns at
        once unless more than :data:`WRITE_HIGH` bytes wait, then once they are down to
        :data:`WRITE_LOW`. A frame queued is sent even if its caller is cancelled.

        Raises:
            ConnectionError: the connection is closed, or broke before the queue drained.
        """
        self.post(parts)
        if self._wbytes > WRITE_HIGH:
            fut = self.loop.create_future()
            self._drain.append(fut)
            await asyncio.shield(fut)

    def post(self, parts: list) -> None:
        """:meth:`send` without waiting for the queue to drain (for small replies sent from a
        callback, where nothing can wait): the frame is queued and leaves at the end of the loop
        turn like any other.

        Raises:
            ConnectionError: the connection is closed or broken.
        """
        if self.closed or self._werr is not None:
            raise ConnectionError("connection closed") from self._werr
        for b in parts:
            if len(b):
                v = memoryview(b).cast("B")
                self._wq.append(v)
                self._wbytes += v.nbytes
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def _write_now(self) -> None:
        """Send what the socket takes now without waiting (``sendmsg`` of the queued buffers)."""
        wq = self._wq
        while wq:
            bufs = list(itertools.islice(wq, IOV_MAX))
            try:
                n = self.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                return
            self._wbytes -= n
            sent_all = n == sum(v.nbytes for v in bufs)
            while n and n >= wq[0].nbytes:
                n -= wq.popleft().nbytes
            if n:
                wq[0] = wq[0][n:]
            if not sent_all:  # the socket's buffer is full
                return

    def _flush(self) -> None:
        """End of the loop turn: write the queue; a rest goes to the writer task."""
        if self.closed or self._werr is not None:
            self._flushing = False
            return
        try:
            self._write_now()
        except OSError as e:
            self._flushing = False
            self._broken(e)
            return
        if self._wq:
            self._writer = self.loop.create_task(self._write_rest())
        else:
            self._flushing = False
            self._drained()

    async def _write_rest(self) -> None:
        """The writer task: what the socket did not take at once, waiting for it to drain."""
        self._ops += 1
        try:
            while self._wq and not self.closed:
                v = self._wq[0]
                await self.loop.sock_sendall(self.sock, v)
                if not self._wq or self._wq[0] is not v:  # closed meanwhile: the queue was dropped
                    break
                self._wq.popleft()
                self._wbytes -= v.nbytes
                self._drained()
                if len(self._wq) > 1:
                    self._write_now()
        except OSError as e:
            self._broken(e)
        finally:
            self._writer = None
            self._flushing = False
            self._drained()
            self._op_done()

    def _drained(self) -> None:
        if self._wbytes <= WRITE_LOW:
            for f in self._drain:
                if not f.done():
                    f.set_result(None)
            self._drain.clear()
            if self._rpaused:
                self.loop.call_soon(self._resume_reading)

    def _broken(self, err: BaseException) -> None:
        """A write failed (or the connection closed): queued frames are dropped, senders waiting
        for the queue to drain get ConnectionError."""
        if self._werr is None:
            self._werr = err
        self._wq.clear()
        self._wbytes = 0
        for f in self._drain:
            if not f.done():
                f.set_exception(ConnectionError(f"connection broken: {err}"))
        self._drain.clear()

    def close(self) -> None:
        """Shut the connection down now: what is queued goes out if the socket takes it at once
        (a reply sent just before the close is not lost), the rest is dropped."""
        if not self.closed:
            if self._wq and self._writer is None and self._werr is None:
                try:
                    self._write_now()
                except OSError:
                    pass
            self.closed = True
            self._broken(ConnectionError("connection closed"))
            self._end_reading(ConnectionError("connection closed"))
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # a receive or send in progress returns now
            except OSError:
                pass
            if not self._ops:
                self.sock.close()

    def _op_done(self) -> None:
        self._ops -= 1
        if self.closed and not self._ops:
            self.sock.close()


# ----------------------------------------------------------------- audio payloads
# segments: one home for the primitives (flashasr.shm), shared with the job runner's workers
_create_shm = create_segment
_open_shm = open_segment
unlink_shm = unlink_segment


class _Seg:
    __slots__ = ("shm", "size", "pooled")

    def __init__(self, shm, size: int, pooled: bool):
        self.shm, self.size, self.pooled = shm, size, pooled


class ShmPool:
    """Sender-side pool of reusable shared-memory segments.

    A fresh segment costs shm_open + ftruncate + mmap and a page fault per 4 KiB page on first
    write (and the receiver's mapping faults again); a reused one costs one memcpy into warm
    pages. Pooled segments (power-of-two sizes >= 1 MiB, at most ``max_bytes`` in total) are
    marked ``SHM_POOLED``: the receiver may read them in place (no copy) and keeps them mapped;
    the sender reuses a segment only after the reply to the request that used it arrived.
    A request that ends without a reply (cancelled, timed out, connection lost) discards its
    segment (unlinked; memory returns once the receiver unmaps it).
    """

    def __init__(self, max_bytes: int = 512 << 20):
        self.max_bytes = max_bytes
        self.total = 0
        self.free: dict[int, list[_Seg]] = {}

    def acquire(self, nbytes: int) -> _Seg:
        size = 1 << max(20, (max(1, nbytes) - 1).bit_length())
        lst = self.free.get(size)
        if lst:
            return lst.pop()
        if self.total + size <= self.max_bytes:
            self.total += size
            return _Seg(_create_shm(size), size, True)
        return _Seg(_create_shm(nbytes), nbytes, False)

    def release(self, seg: _Seg, reusable: bool) -> None:
        if seg.pooled and reusable:
            self.free.setdefault(seg.size, []).append(seg)
            return
        if seg.pooled:
            self.total -= seg.size
        name = seg.shm.name
        seg.shm.close()
        unlink_shm(name)

    def close(self) -> None:
        for lst in self.free.values():
            for seg in lst:
                self.release(seg, reusable=False)
        self.free.clear()


_ONE_OFF = ShmPool(max_bytes=0)


class _Attached:
    """Receiver-side cache of mapped pooled segments (name -> SharedMemory), bounded in bytes."""

    def __init__(self, max_bytes: int = 2 << 30):
        self.max_bytes = max_bytes
        self.maps: dict[str, shared_memory.SharedMemory] = {}

    def get(self, name: str) -> shared_memory.SharedMemory:
        shm = self.maps.pop(name, None)
        if shm is None:
            shm = _open_shm(name)
        self.maps[name] = shm  # most recently used last
        total = sum(m.size for m in self.maps.values())
        for old in list(self.maps):
            if total <= self.max_bytes or old == name:
                break
            try:
                self.maps[old].close()  # BufferError while a waveform still uses it: keep it
            except BufferError:
                continue
            total -= self.maps.pop(old).size
        return shm


_ATTACHED = _Attached()


def pack_audio(samples: np.ndarray, shm_threshold: int, pool: ShmPool | None = None, segment: str | None = None):
    """Prepare samples for a TRANSCRIBE frame.

    Args:
        samples: float32 [N] (or int16 [N]) mono samples.
        shm_threshold: payloads larger than this many bytes go through shared memory.
        pool: the sender's :class:`ShmPool` (None: a one-off segment the receiver unlinks).
        segment: a segment whose first bytes already are ``samples`` (float32, contiguous): sent
            by name as a one-off segment (the receiver maps it in place and unlinks the name), no
            copy; the caller keeps its own mapping and unlinks the name too when done.
    Returns:
        ``(flags, meta, payload, handle)``; ``handle`` is None or must be given back with
        :func:`release_audio` once the request is over.
    """
    a = np.ascontiguousarray(samples)
    flags = Flag.PCM16 if a.dtype == np.int16 else Flag.NONE
    if a.dtype not in (np.int16, np.float32):
        a = a.astype(np.float32)
    meta = {"n": int(a.size)}
    if segment is not None and a is samples and a.dtype == np.float32 and a.nbytes > shm_threshold:
        meta["shm"] = str(segment)
        return int(flags | Flag.SHM), meta, b"", None
    if a.nbytes > shm_threshold:
        pool = pool or _ONE_OFF
        seg = pool.acquire(a.nbytes)
        np.ndarray(a.shape, a.dtype, buffer=seg.shm.buf)[:] = a
        meta["shm"] = seg.shm.name
        flags |= Flag.SHM | (Flag.SHM_POOLED if seg.pooled else 0)
        return int(flags), meta, b"", (pool, seg)
    return int(flags), meta, memoryview(a).cast("B"), None


def release_audio(handle, replied: bool) -> None:
    """Give a shared-memory handle from :func:`pack_audio` back (reused only if the reply arrived)."""
    if handle is not None:
        pool, seg = handle
        pool.release(seg, reusable=replied)


def _map_one_off(name: str, dtype, n: int, need: int) -> np.ndarray:
    """A one-off segment mapped in place and its name unlinked at once: the memory lives as long as
    the returned array (no copy: a 4-hour upload's 920 MB are not held twice in the engine)."""
    import mmap
    import os

    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise FramingError(f"no shared-memory segment {name!r}") from None
    try:
        if os.fstat(fd).st_size < need:
            raise FramingError("shared-memory segment smaller than the declared sample count")
        m = mmap.mmap(fd, max(1, need))
    finally:
        os.close(fd)
        unlink_shm(name)
    return np.frombuffer(m, dtype, count=n)


def unpack_audio(frame: Frame) -> np.ndarray:
    """Samples of a TRANSCRIBE frame as float32 [N].

    Inline payloads are used where they landed; pooled shared memory is read in place (the
    sender does not touch the segment before our reply); a one-off segment is mapped in place
    and its name unlinked at once (the sender unlinks nothing more after our reply).
    """
    n = int(frame.meta.get("n", -1))
    flags = int(frame.flags)
    dtype = np.int16 if flags & _PCM16 else np.float32
    if flags & _SHM:
        name = frame.meta.get("shm")
        if not isinstance(name, str) or n < 0:
            raise FramingError("SHM frame without shm name / sample count")
        need = n * np.dtype(dtype).itemsize
        if flags & _SHM_POOLED:
            shm = _ATTACHED.get(name)
            if shm.size < need:
                raise FramingError("shared-memory segment smaller than the declared sample count")
            a = np.ndarray((n,), dtype, buffer=shm.buf)
        else:
            a = _map_one_off(name, dtype, n, need)
    else:
        if len(frame.payload) % np.dtype(dtype).itemsize:
            raise FramingError("payload length is not a whole number of samples")
        a = np.frombuffer(frame.payload, dtype=dtype)
        if not a.flags.writeable:
            a = a.copy()  # torch warns on read-only buffers (bytes payloads)
        if n >= 0 and a.size != n:
            raise FramingError(f"payload holds {a.size} samples, metadata says {n}")
    if dtype == np.int16:
        return a.astype(np.float32) / 32768.0
    return a


# ------------------------------------------------------------ transcript transport
def transcript_to_wire(t: Transcript) -> dict:
    return {
        "text": t.text, "language": t.language, "duration": t.duration, "model": t.model,
        "segments": [[s.id, s.start, s.end, s.text, list(s.tokens), s.avg_logprob, s.no_speech_prob,
                      s.compression_ratio, s.temperature, s.seek,
                      [[w.word, w.start, w.end, w.probability] for w in s.words]] for s in t.segments],
        "words": None if t.words is None else [[w.word, w.start, w.end, w.probability] for w in t.words],
        "task": t.task, "language_probability": t.language_probability, "language_probs": t.language_probs,
        "warnings": list(t.warnings),
    }


def transcript_from_wire(d: dict) -> Transcript:
    segs = [Segment(id=s[0], start=s[1], end=s[2], text=s[3], tokens=s[4], avg_logprob=s[5],
                    no_speech_prob=s[6], compression_ratio=s[7], temperature=s[8], seek=s[9],
                    words=[Word(*w) for w in s[10]]) for s in d.get("segments", [])]
    words = None if d.get("words") is None else [Word(*w) for w in d["words"]]
    return Transcript(text=d["text"], language=d.get("language"), duration=d.get("duration", 0.0),
                      segments=segs, words=words, model=d.get("model"), task=str(d.get("task", "transcribe")),
                      language_probability=d.get("language_probability"), language_probs=d.get("language_probs"),
                      warnings=list(d.get("warnings") or []))


# ------------------------------------------------------------------ client side
class EngineClient:
    """A front end's persistent connection to the engine process.

    Requests are multiplexed over one Unix socket by request id. When the connection
    drops (engine died), every in-flight request fails at once with
    :class:`EngineUnavailable` (HTTP 503) and the client reconnects in the background.
    A request made while no connection is up waits for one up to ``connect_wait_s`` (each
    front end connects on its own: one can take requests a moment before the engine has
    greeted it), then gets the 503 naming why (:meth:`unavailable_reason`). :meth:`close`
    wakes every request still waiting on the engine -- for a connection, inside a send, for
    its reply -- with the 503 'shutting down'.

    ``engine_seen``: the engine was serving when this front end started (a replaced worker: the
    supervisor says so), so before its first connection it counts as restarting, not starting;
    ``engine_restarts``: the supervisor's count then, until a HELLO says it.
    """

    def __init__(self, path: str, *, shm_threshold: int = 1 << 20, metrics=None, connect_wait_s: float = 5.0,
                 engine_seen: bool = False, engine_restarts: int = 0):
        self.path = path
        self.connect_wait_s = connect_wait_s
        self.shm_threshold = shm_threshold
        self.metrics = metrics
        self.info: dict = {}
        self._conn: Conn | None = None
        self._pool = ShmPool()
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._stream_options: set[str] = set()  # chunked streams whose options the engine has (stream_chunk)
        self._task: asyncio.Task | None = None
        self._connected = asyncio.Event()  # set while connected, and for good once stopping (wakes the waiters)
        self._closed = False
        self._stopping = False  # begin_shutdown(): the server is stopping
        self.connects = 0
        self.engine_seen = engine_seen
        self.engine_restarts = engine_restarts  # the last HELLO's (or the supervisor's at start)

    @property
    def ready(self) -> bool:
        return self._conn is not None and bool(self.info)

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._connect_loop(), name="flashasr-engine-client")

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the engine connection; whether it is up (False at once
        when the client closes meanwhile; no wait once the server is stopping: no connection
        comes then, and a request must get its 503 within the grace)."""
        if not (self._closed or self._stopping):
            try:
                await asyncio.wait_for(self._connected.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.ready

    def unavailable_reason(self) -> str:
        """Why no request can go to the engine now: shutting down, starting (never connected yet:
        the engine is loading the model) or restarting (the connection was lost)."""
        if self._closed or self._stopping:
            return SHUTTING_DOWN
        if self.connects == 0 and not self.engine_seen:
            return "the transcription engine is starting (loading the model); retry shortly"
        return "the transcription engine is restarting; retry shortly"

    async def connection(self) -> "Conn":
        """The engine connection, waiting up to ``connect_wait_s`` for one; raises
        :class:`EngineUnavailable` (503) with :meth:`unavailable_reason` when none comes."""
        c = self._conn
        if c is None and not self._stopping and await self.wait_ready(self.connect_wait_s):
            c = self._conn
        if c is None:
            raise EngineUnavailable(self.unavailable_reason())
        return c

    def begin_shutdown(self) -> None:
        """The server is stopping: from now on a request that finds no engine connection, or loses
        it, gets the 503 'shutting down' at once (no wait, no reconnecting), and a lost connection is
        no warning (the engine stops after the front ends, but may be killed first); a request
        waiting for a connection now wakes and gets it."""
        self._stopping = True
        self._connected.set()  # wakes wait_ready(): no connection comes any more

    async def close(self) -> None:
        """Stop for good: every request waiting on the engine fails now with the 503 'shutting
        down' (those waiting for a connection wake and find none, a send in progress fails as the
        socket shuts down, those waiting for a reply get the error); idempotent."""
        self._closed = True
        conn, self._conn = self._conn, None
        self._connected.set()
        if conn is not None:
            conn.close()
        self._fail_all(EngineUnavailable(self.unavailable_reason()))
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # its connection closed and nothing left pending
        self._pool.close()

    def _fail_all(self, err: Exception) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def _connect_loop(self) -> None:
        delay = 0.05
        while not (self._closed or self._stopping):
            try:
                conn = await Conn.connect(self.path)
            except (FileNotFoundError, ConnectionRefusedError, OSError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            try:
                hello = await asyncio.wait_for(conn.recv_frame(), 30)
                if hello.type != MsgType.HELLO:
                    raise FramingError("engine did not greet with HELLO")
                self.info = hello.meta
                self.engine_restarts = int(hello.meta.get("engine_restarts", self.engine_restarts))
                if self.metrics is not None and hasattr(self.metrics, "engine_restarts"):
                    self.metrics.engine_restarts.set(self.engine_restarts)
                self._conn = conn
                self.connects += 1
                self._connected.set()
                delay = 0.05
                log.info("connected to engine pid %s (%s)", self.info.get("pid"), self.info.get("model"))
                while True:
                    f = await conn.recv_frame()
                    fut = self._pending.pop(f.req_id, None)
                    if fut is None or fut.done():
                        continue
                    fut.set_result(f)
            except (asyncio.IncompleteReadError, ConnectionError, FramingError, asyncio.TimeoutError, OSError) as e:
                if not (self._closed or self._stopping):
                    log.warning("engine connection lost: %s", e)
                else:
                    log.info("engine connection closed while shutting down (%s)", e)
            finally:
                self._conn = None
                self.info = {}
                if not (self._closed or self._stopping):
                    self._connected.clear()
                conn.close()
                self._fail_all(EngineUnavailable(self.unavailable_reason()))
            await asyncio.sleep(delay)

    async def _request(self, mtype: int, meta: dict, payload=b"", flags: int = 0, timeout: float | None = None):
        c = await self.connection()
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await c.send(encode(mtype, rid, meta, payload, flags))
            return await (asyncio.wait_for(fut, timeout) if timeout else fut)
        except asyncio.CancelledError:
            # the client went away: tell the engine to drop the work
            self._cancel(c, rid)
            raise
        except asyncio.TimeoutError:
            self._cancel(c, rid)
            raise APIError("transcription timed out", status=504, code="timeout") from None
        except (ConnectionError, OSError):
            raise EngineUnavailable(self.unavailable_reason()) from None
        finally:
            self._pending.pop(rid, None)

    def _cancel(self, c: Conn, rid: int) -> None:
        if self._conn is c and not c.closed:
            t = asyncio.get_running_loop().create_task(c.send(encode(MsgType.CANCEL, rid)))
            t.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def transcribe(self, samples: np.ndarray, options: TranscribeOptions, *, pieces=None,
                         priority: int = 2, coalesce_key: str | None = None,
                         timeout: float | None = None, segment: str | None = None) -> list[Transcript] | None:
        """Transcribe float32 [N] 16 kHz samples in the engine: the whole waveform (``pieces`` None:
        one transcript), or its ``pieces`` ``[(start, end), ...]`` (one transcript per piece; the
        samples cross once). ``segment``: a shared-memory segment whose first bytes are ``samples``
        (the decode's, :attr:`flashasr.audio.DecodedAudio.segment`): the engine maps it in place
        and unlinks its name, nothing is copied (the caller unlinks it too, after). Returns None for
        a superseded partial. Raises EngineUnavailable (503), or the engine's error as an APIError
        with its code and status."""
        flags, meta, payload, shm = pack_audio(samples, self.shm_threshold, self._pool, segment=segment)
        meta.update(options=options.to_dict(), priority=int(priority))
        if pieces is not None:
            meta["pieces"] = [[int(a), int(b)] for a, b in pieces]
            spans = [getattr(p, "speech", None) for p in pieces]
            if any(sp is not None for sp in spans):
                meta["speech"] = [None if sp is None else [[int(a), int(b)] for a, b in sp] for sp in spans]
        if coalesce_key is not None:
            meta["key"] = coalesce_key
        if self.metrics is not None:
            self.metrics.inflight.inc()
        f = None
        try:
            f = await self._request(MsgType.TRANSCRIBE, meta, payload, flags, timeout)
        finally:
            release_audio(shm, replied=f is not None)
            if self.metrics is not None:
                self.metrics.inflight.dec()
        if f.type == MsgType.ERROR:
            m = f.meta
            raise APIError(m.get("message", "engine error"), status=int(m.get("status", 500)),
                           code=m.get("code", "internal_error"), param=m.get("param"))
        if f.meta.get("superseded"):
            return None
        return [transcript_from_wire(d) for d in f.meta["transcripts"]]

    async def stream_chunk(self, key: str, samples: np.ndarray, options: TranscribeOptions, *, new: bool = False,
                           timeout: float | None = None):
        """A chunked stream's new audio through the engine's streamer -> its StreamResult (raises
        EngineUnavailable, or the engine's error as an APIError)."""
        flags, meta, payload, shm = pack_audio(samples, self.shm_threshold, self._pool)
        meta.update(priority=1, stream=str(key))
        if new or key not in self._stream_options:  # the engine keeps a stream's options from its first chunk
            meta.update(options=options.to_dict(), new=bool(new))
            self._stream_options.add(key)
        f = None
        try:
            f = await self._request(MsgType.TRANSCRIBE, meta, payload, flags, timeout)
        finally:
            release_audio(shm, replied=f is not None)
        if f.type == MsgType.ERROR:
            m = f.meta
            raise APIError(m.get("message", "engine error"), status=int(m.get("status", 500)),
                           code=m.get("code", "internal_error"), param=m.get("param"))
        return StreamResult(**f.meta["stream_result"])

    def stream_close(self, key: str) -> None:
        """Tell the engine to drop a chunked stream's state (fire and forget; a lost connection
        drops every state of this front end anyway)."""
        self._stream_options.discard(key)
        c = self._conn
        if c is not None and not c.closed:
            t = asyncio.get_running_loop().create_task(c.send(encode(MsgType.STREAM_CLOSE, 0, {"stream": str(key)})))
            t.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def stats(self, timeout: float = 2.0) -> bytes:
        """Prometheus text exposition of the engine's metrics (empty if unavailable)."""
        try:
            f = await self._request(MsgType.STATS, {}, timeout=timeout)
            return bytes(f.payload)
        except Exception:  # noqa: BLE001
            return b""
