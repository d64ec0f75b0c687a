"""The plain values the clients take and return, and their conversions to and from the generated
protobuf messages (the package's one proto boundary)."""
from dataclasses import dataclass, field
from typing import List, Optional

from xfer.v1 import xfer_pb2 as pb

WRITE = "write"
READ = "read"


@dataclass(frozen=True)
class Segment:
    """``length`` bytes between ``local`` of the local region and ``remote`` of the remote region
    (absolute offsets)."""

    local: int
    remote: int
    length: int

    def to_pb(self):
        return pb.Segment(local_offset=self.local, remote_offset=self.remote, length=self.length)


@dataclass
class Region:
    id: str
    name: str
    length: int
    kind: str  # "anonymous", "file" or "shm"
    path: str
    unavailable: Optional[str] = None

    @staticmethod
    def from_pb(r):
        kind = {pb.REGION_KIND_FILE: "file", pb.REGION_KIND_SHM: "shm"}.get(r.kind, "anonymous")
        return Region(r.id, r.name, r.length, kind, r.path, r.unavailable_reason or None)


_STATES = {
    pb.TRANSFER_STATE_QUEUED: "queued",
    pb.TRANSFER_STATE_CONNECTING: "connecting",
    pb.TRANSFER_STATE_RUNNING: "running",
    pb.TRANSFER_STATE_SUCCEEDED: "succeeded",
    pb.TRANSFER_STATE_FAILED: "failed",
    pb.TRANSFER_STATE_CANCELLED: "cancelled",
}
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Transfer:
    id: str
    state: str
    length: int
    bytes_done: int
    segments: int
    error: str
    error_code: str
    elapsed: float
    peer: str

    @staticmethod
    def from_pb(t):
        return Transfer(t.id, _STATES.get(t.state, "queued"), t.length, t.bytes_done, t.segments, t.error, t.error_code,
                        t.elapsed_seconds, t.peer)


@dataclass
class Notification:
    region: str
    peer: str
    tag: bytes
    op: str
    offset: int
    length: int
    via: str

    @staticmethod
    def from_pb(n):
        return Notification(n.region, n.peer, bytes(n.tag), READ if n.op == pb.OP_READ else WRITE, n.offset, n.length, n.via)


@dataclass
class RingInfo:
    """Where a ``WatchInboundRing`` subscription's ring is: the stream's one message."""

    object: str
    length: int
    slots: int
    slot_size: int

    @staticmethod
    def from_pb(r):
        return RingInfo(r.object, r.length, r.slots, r.slot_size)


def watch_inbound_ring_pb(region=None, tag=None, slots=0):
    return pb.WatchInboundRingRequest(region=region or "", tag=tag, slots=slots or 0)


@dataclass
class BatchDone:
    seq: int
    bytes: int
    segments: int
    seconds: float
    prep_ns_per_segment: float


def op_pb(op):
    if op not in (WRITE, READ):
        raise ValueError(f"op must be {WRITE!r} or {READ!r}, not {op!r}")
    return pb.OP_WRITE if op == WRITE else pb.OP_READ


def options_pb(qps=None, depth=None, chunk_size=None, timeout=None, verify=False):
    o = pb.TransferOptions(qps=qps or 0, depth=depth or 0, chunk_size=chunk_size or 0, verify=verify)
    if timeout:
        o.timeout.FromNanoseconds(int(timeout * 1e9))
    return o


def submit_pb(op, local, peer, remote, *, segments=None, notify=None, local_offset=0, remote_offset=0, length=0, **opts):
    return pb.SubmitTransferRequest(
        op=op_pb(op),
        local=pb.LocalRange(region=local, offset=local_offset),
        remote=pb.RemoteRange(agent=peer, region=remote, offset=remote_offset),
        length=length,
        options=options_pb(**opts),
        segments=[s.to_pb() for s in (segments or [])],
        notify=notify,
    )


def create_pb(name, length, kind="anonymous", path="", access="rw"):
    kinds = {"anonymous": pb.REGION_KIND_ANONYMOUS, "file": pb.REGION_KIND_FILE, "shm": pb.REGION_KIND_SHM}
    accesses = {"r": pb.ACCESS_READ, "w": pb.ACCESS_WRITE, "rw": pb.ACCESS_READ_WRITE}
    return pb.CreateRegionRequest(name=name, length=length, kind=kinds[kind], path=path, access=accesses[access])


def channel_open_pb(op, local, peer, remote, offset=0, length=0, notify=True, ttl=None, **opts):
    o = pb.ChannelOpen(op=op_pb(op), local_region=local, remote=pb.RemoteRange(agent=peer, region=remote, offset=offset),
                       length=length, options=options_pb(**opts), notify=notify)
    if ttl:
        o.ttl.FromNanoseconds(int(ttl * 1e9))
    return pb.ChannelRequest(open=o)


def channel_post_pb(seq, segments=None, list_id=0, notify=None):
    return pb.ChannelRequest(post=pb.ChannelPost(seq=seq, segments=[s.to_pb() for s in (segments or [])], list=list_id, notify=notify))


def channel_prepare_pb(list_id, segments):
    return pb.ChannelRequest(prepare=pb.ChannelPrepare(list=list_id, segments=[s.to_pb() for s in segments]))


def batch_done(ev):
    """A BatchDone event as a BatchDone, or the BatchFailed to raise."""
    from xfer.errors import BatchFailed

    d = ev.done
    if d.state != pb.TRANSFER_STATE_SUCCEEDED:
        return BatchFailed(d.seq, d.error_code, d.error)
    return BatchDone(d.seq, d.bytes, d.segments, d.seconds, d.prep_ns_per_segment)


PUT_PIECE = 1 << 20


def put_messages(region, offset, data):
    view = memoryview(data).cast("B")
    if len(view) == 0:
        raise ValueError("nothing to write")
    for i in range(0, len(view), PUT_PIECE):
        first = i == 0
        yield pb.WriteRegionRequest(region=region if first else "", offset=offset if first else 0, data=bytes(view[i:i + PUT_PIECE]))
