"""Python client of the xfer agent.

``Client`` (blocking) and ``AsyncClient`` (asyncio) do the same: regions (``create_region``,
``put``, ``get``), transfers and batches (``submit``/``transfer`` with ``segments=[Segment...]``
and ``notify=b"tag"``, ``wait``, ``cancel``), notifications of this agent (``watch_inbound``, or
``watch_inbound_ring`` through shared memory on x86-64), channels (``open_channel``: one grant,
many batches, prepared lists) and shared-memory regions mapped into this process
(``create_shm_region``: ``.buffer`` is a memoryview, ``.array()`` a NumPy array). Errors are
subclasses of ``XferError``.

    import xfer
    prefill, decode = xfer.Client("10.0.0.1:7470"), xfer.Client("10.0.0.2:7470")
    pool = prefill.create_shm_region("kv", 64 << 20)
    pool.buffer[0:4096] = bytes(4096)                 # filled in place
    decode.create_region("kv", 64 << 20)
    inbound = decode.watch_inbound("kv", tag=b"req-7")
    prefill.transfer(xfer.WRITE, "kv", "10.0.0.2:7470", "kv",
                     segments=[xfer.Segment(0, 9 * 4096, 4096)], notify=b"req-7")
    note = next(inbound)                              # every byte of the batch is in place
"""
from xfer._aio import AsyncChannel, AsyncClient, AsyncInbound
from xfer._sync import Channel, Client, Inbound
from xfer.errors import (Aborted, AlreadyExists, BatchFailed, Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition,
                         InvalidArgument, NotFound, OutOfRange, PermissionDenied, ResourceExhausted, TransferFailed,
                         Unauthenticated, Unavailable, XferError)
from xfer.ring import AsyncRing, Ring
from xfer.shm import ShmRegion
from xfer.types import READ, WRITE, BatchDone, Notification, Region, Segment, Transfer

__all__ = [
    "Client", "AsyncClient", "Channel", "AsyncChannel", "Inbound", "AsyncInbound", "Ring", "AsyncRing", "ShmRegion",
    "Segment", "Region", "Transfer", "Notification", "BatchDone", "READ", "WRITE",
    "XferError", "InvalidArgument", "NotFound", "AlreadyExists", "PermissionDenied", "Unauthenticated",
    "ResourceExhausted", "FailedPrecondition", "Unavailable", "Aborted", "DeadlineExceeded", "DataLoss",
    "Cancelled", "OutOfRange", "TransferFailed", "BatchFailed",
]
