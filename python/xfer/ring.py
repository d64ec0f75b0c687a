"""Notifications through a shared-memory ring (``Client.watch_inbound_ring``): the agent writes
every notification of the subscription into an object under /dev/shm that this process maps, so
receiving one costs a few loads and a copy of one slot: no gRPC message, no socket read, no
thread hand-off. The layout is ``crates/xfer-rdma/src/ring.rs`` (version 1); this reader does
what its ``RingReader::try_next`` does.

The subscription lives as long as the ``Ring``: it holds the ``WatchInboundRing`` call, and the
agent closes the ring and removes the object when the call ends (``close()``).

Readers here only load: they never write into the ring, so they do not use its futex (the Rust
reader sleeps on it); ``next()`` polls, spinning for ``spin`` and then sleeping in short steps
of at most 1 ms.

x86-64 only. A slot is read as a seqlock (its sequence word, a copy of the slot, the sequence
word again), which is correct only if the processor keeps loads in program order, as x86-64 does
(TSO) and as Python cannot ask for on other processors (it has no fences). Elsewhere opening a
ring raises FailedPrecondition: use ``watch_inbound`` (the stream) there.
"""
import asyncio
import mmap
import os
import platform
import stat
import sys
import time

from xfer import types as t
from xfer.errors import DataLoss, FailedPrecondition, Unavailable

SHM_DIR = "/dev/shm"

MAGIC = b"XFERRING"
VERSION = 1
HEADER = 256
SLOT_FIXED = 64
MAX_TAG = 64 << 10
# The largest slot: the largest tag and two names of at most 65,535 bytes (ring.rs MAX_SLOT_SIZE).
MAX_SLOT_SIZE = -(-(SLOT_FIXED + MAX_TAG + 2 * 0xFFFF) // 64) * 64
MIN_SLOTS = 16
MAX_SLOTS = 1 << 16
FLAG_CLOSED = 1
# Word indexes: 64-bit words (cast "Q") and 32-bit words (cast "I") of the mapping.
_Q_HEAD = 64 // 8
_I_VERSION, _I_SLOT_SIZE, _I_SLOTS, _I_FLAGS = 8 // 4, 12 // 4, 16 // 4, 20 // 4

_OPS = {1: t.WRITE, 2: t.READ}
_VIAS = {1: "fabric", 2: "complete"}
_X86_64 = ("x86_64", "amd64")

# Longest sleep between two polls once the spin is over.
MAX_BACKOFF = 1e-3
_FIRST_BACKOFF = 20e-6


def check_platform():
    """Raises FailedPrecondition unless this is a 64-bit Python on x86-64 (see the module's doc)."""
    machine = platform.machine()
    if machine.lower() not in _X86_64 or sys.maxsize <= 2**32:
        raise FailedPrecondition(
            f"notification rings are read only on x86-64 by a 64-bit Python (this is {machine!r}, "
            f"{'64' if sys.maxsize > 2**32 else '32'}-bit): the Python reader needs the processor's load "
            f"ordering (TSO) and has no fences; use watch_inbound (the stream) instead")


class Ring:
    """A reader of one notification ring. Made by ``Client.watch_inbound_ring``; may also be opened
    directly over an object of /dev/shm (``Ring("xfer.ring....")``), without a subscription.

    ``object``, ``length``, ``slots`` and ``slot_size`` describe the ring; ``position`` is the
    number of the next notification this reader returns."""

    def __init__(self, object, length=None, *, call=None, expect=None):
        self._call = call
        self._mm = None
        self._views = []
        self.object = object
        try:
            self._open(object, length, expect)
        except BaseException:
            self._unmap()
            raise

    def _open(self, object, length, expect):
        check_platform()
        # An object name, never a path: the agent's own rule, checked again here.
        if not object or "/" in object or object.startswith(".") or "\0" in object:
            raise FailedPrecondition(f"notification ring object name {object!r}")
        path = os.path.join(SHM_DIR, object)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise FailedPrecondition(f"notification ring {path}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FailedPrecondition(f"notification ring {path} is not a regular file")
            if length is None:
                length = st.st_size
            if length < HEADER:
                raise FailedPrecondition(f"not a notification ring: {path} has {length} bytes, less than its header")
            if st.st_size < length:
                raise FailedPrecondition(f"notification ring {path} is {st.st_size} bytes, the agent said {length}")
            # Read-only: this reader writes nothing into the ring.
            self._mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.length = length
        mm = self._mm
        if mm[0:8] != MAGIC:
            raise FailedPrecondition(f"not a notification ring: {path} has magic {bytes(mm[0:8])!r}, not {MAGIC!r}")
        # One aligned load per word (the mapping is page-aligned, every word naturally aligned).
        self._q = memoryview(mm).cast("Q")
        self._i = memoryview(mm).cast("I")
        self._views = [self._q, self._i]
        version, slot_size, slots = self._i[_I_VERSION], self._i[_I_SLOT_SIZE], self._i[_I_SLOTS]
        if version != VERSION:
            raise FailedPrecondition(f"not a notification ring this reader knows: {path} has version {version}, "
                                     f"this reader knows {VERSION}")
        if not MIN_SLOTS <= slots <= MAX_SLOTS or slots & (slots - 1):
            raise FailedPrecondition(f"not a notification ring: {path} has {slots} slots, not a power of two "
                                     f"between {MIN_SLOTS} and {MAX_SLOTS}")
        if slot_size < SLOT_FIXED or slot_size > MAX_SLOT_SIZE or slot_size % 64:
            raise FailedPrecondition(f"not a notification ring: {path} has slots of {slot_size} bytes, "
                                     f"not a multiple of 64 from {SLOT_FIXED} to {MAX_SLOT_SIZE}")
        if length < HEADER + slots * slot_size:
            raise FailedPrecondition(f"not a notification ring: {slots} slots of {slot_size} bytes do not fit "
                                     f"in {path}'s {length} bytes")
        if expect is not None and (expect.slots, expect.slot_size) != (slots, slot_size):
            raise FailedPrecondition(f"notification ring {path} has {slots} slots of {slot_size} bytes, "
                                     f"the agent said {expect.slots} of {expect.slot_size}")
        self.slots, self.slot_size = slots, slot_size
        # Starts at the oldest notification still held (a fresh ring: the first one).
        self.position = max(0, self._q[_Q_HEAD] - slots)

    @property
    def closed(self):
        """True once the agent closed the ring (nothing more will be written into it), or this
        process did (``close()``)."""
        return self._mm is None or bool(self._i[_I_FLAGS] & FLAG_CLOSED)

    def try_next(self):
        """The next notification if one was published, else None, without waiting. Raises
        DataLoss (once; ``.lost`` is how many) when this reader fell more than ``slots`` behind:
        the next call goes on with the oldest notification still held. Raises Unavailable once
        every notification was read and the agent closed the ring."""
        if self._mm is None:
            raise Unavailable(f"notification ring {self.object} was closed by this process")
        q = self._q
        # Closed is read first: the writer closes after its last publication, so a head read
        # after seeing the flag is final.
        closed = self._i[_I_FLAGS] & FLAG_CLOSED
        head = q[_Q_HEAD]
        n = self.position
        if head == n:
            if closed:
                raise Unavailable(f"the agent closed notification ring {self.object}")
            return None
        if head < n:
            raise FailedPrecondition(f"notification ring {self.object}: head {head} went back below {n}")
        slots = self.slots
        if head - n > slots:
            raise self._skip_to(head - slots)
        slot = HEADER + (n % slots) * self.slot_size
        # Seqlock read: seq, the slot, seq again; the copy is whole only if both are n + 1.
        s1 = q[slot // 8]
        if s1 != n + 1:
            # Overwritten (or being overwritten) by a later notification.
            raise self._lag_from_head()
        body = self._mm[slot + 8:slot + self.slot_size]
        if q[slot // 8] != s1:
            raise self._lag_from_head()
        note = self._parse(n, body)
        self.position = n + 1
        return note

    def next(self, timeout=None, spin=50e-6):
        """Waits for the next notification: polls for ``spin`` seconds, then sleeps in steps that
        grow to 1 ms between polls; None after ``timeout`` seconds (None: no limit). Raises as
        ``try_next`` does, and Unavailable if the subscription's call ended (the agent went away)."""
        start = time.monotonic()
        delay = _FIRST_BACKOFF
        while True:
            note = self.try_next()
            if note is not None:
                return note
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                return None
            if waited < spin:
                continue
            self._check_call()
            step = delay if timeout is None else min(delay, timeout - waited)
            time.sleep(max(step, 0))
            delay = min(delay * 2, MAX_BACKOFF)

    def __iter__(self):
        return self

    def __next__(self):
        return self.next()

    def _check_call(self):
        # The call's only message was the ring: if it is over, the agent ended the subscription
        # (or went away) and may never mark the ring closed. Notifications already in the ring
        # were read before this is checked.
        if self._call is not None and self._call.done():
            raise Unavailable(f"the agent ended notification ring {self.object}")

    def _lag_from_head(self):
        head = self._q[_Q_HEAD]
        return self._skip_to(max(head - self.slots, self.position + 1))

    def _skip_to(self, oldest):
        lost = max(oldest - self.position, 0)
        self.position = max(oldest, self.position)
        e = DataLoss(f"notification ring {self.object}: this reader fell behind and lost {lost} notifications")
        e.lost = lost
        return e

    def _parse(self, n, b):
        """A slot's body (after seq) as a Notification (offsets below are of the slot minus 8)."""
        region_len = int.from_bytes(b[28:30], "little")
        peer_len = int.from_bytes(b[30:32], "little")
        tag_len = int.from_bytes(b[32:36], "little")
        var = SLOT_FIXED - 8
        if tag_len + region_len + peer_len > len(b) - var:
            raise FailedPrecondition(f"notification ring {self.object}: notification {n} has lengths past its slot")
        op, via = _OPS.get(b[24]), _VIAS.get(b[25])
        if op is None or via is None:
            raise FailedPrecondition(f"notification ring {self.object}: notification {n} has op {b[24]}, via {b[25]}")
        r = var + tag_len
        p = r + region_len
        try:
            region, peer = b[r:p].decode(), b[p:p + peer_len].decode()
        except UnicodeDecodeError:
            raise FailedPrecondition(f"notification ring {self.object}: notification {n} has a name that is not UTF-8") from None
        return t.Notification(region=region, peer=peer, tag=bytes(b[var:r]), op=op,
                              offset=int.from_bytes(b[8:16], "little"), length=int.from_bytes(b[16:24], "little"), via=via)

    def close(self):
        """Ends the subscription (the agent closes the ring and removes its object) and unmaps."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self._unmap()

    def _unmap(self):
        for v in self._views:
            v.release()
        self._views = []
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<{type(self).__name__} {self.object} position={getattr(self, 'position', None)}>"


class AsyncRing(Ring):
    """A Ring whose ``next`` is a coroutine (``AsyncClient.watch_inbound_ring``): it polls,
    yielding to the event loop between polls, for ``spin``, then with ``asyncio.sleep`` steps that
    grow to 1 ms (the event loop's own timer resolution is about 1 ms)."""

    async def next(self, timeout=None, spin=50e-6):
        loop = asyncio.get_running_loop()
        start = loop.time()
        delay = _FIRST_BACKOFF
        while True:
            note = self.try_next()
            if note is not None:
                return note
            waited = loop.time() - start
            if timeout is not None and waited >= timeout:
                return None
            if waited < spin:
                await asyncio.sleep(0)
                continue
            self._check_call()
            step = delay if timeout is None else min(delay, timeout - waited)
            await asyncio.sleep(max(step, 0))
            delay = min(delay * 2, MAX_BACKOFF)

    __iter__ = None  # iterated with `async for`

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.next()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()
