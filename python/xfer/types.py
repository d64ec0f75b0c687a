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
        """As a protobuf ``Segment``."""
        return pb.Segment(local_offset=self.local, remote_offset=self.remote, length=self.length)


@dataclass
class Region:
    """A region as the agent describes it; ``unavailable`` is why a restored one is not usable."""

    id: str
    name: str
    length: int
    kind: str  # "anonymous", "file" or "shm"
    path: str
    unavailable: Optional[str] = None

    @staticmethod
    def from_pb(r):
        """From its protobuf message."""
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
    """A transfer's record: ``state`` one of queued, connecting, running, succeeded, failed,
    cancelled; ``elapsed`` in seconds."""

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
        """From its protobuf message."""
        return Transfer(t.id, _STATES.get(t.state, "queued"), t.length, t.bytes_done, t.segments, t.error, t.error_code,
                        t.elapsed_seconds, t.peer)


@dataclass
class Notification:
    """A batch that landed in this agent's ``region``: who sent it, its tag, the granted range and
    how it was known (``via`` "fabric" or "complete")."""

    region: str
    peer: str
    tag: bytes
    op: str
    offset: int
    length: int
    via: str

    @staticmethod
    def from_pb(n):
        """From its protobuf message."""
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
        """From its protobuf message."""
        return RingInfo(r.object, r.length, r.slots, r.slot_size)


def watch_inbound_ring_pb(region=None, tag=None, slots=0):
    return pb.WatchInboundRingRequest(region=region or "", tag=tag, slots=slots or 0)


@dataclass
class BatchDone:
    """A channel batch that succeeded: its number, bytes, segments after coalescing, seconds."""

    seq: int
    bytes: int
    segments: int
    seconds: float
    prep_ns_per_segment: float


@dataclass
class Device:
    """An RDMA device of the agent (none on the tcp fabric)."""

    name: str
    port: int
    state: str
    link_layer: str
    active_mtu: int
    numa_node: Optional[int]
    pci_address: Optional[str]
    speed_mbps: Optional[int]
    netdev: Optional[str]


@dataclass
class Limits:
    """What the agent may hold, and its memlock limits (bytes; 2**64 - 1 is unlimited)."""

    memlock_soft: int
    memlock_hard: int
    cap_ipc_lock: bool
    max_regions: int
    max_registered_bytes: int
    max_transfers: int


@dataclass
class AgentInfo:
    """``Client.info()``: the agent's node, version, fabric (and why), devices, limits and use."""

    node_name: str
    version: str
    fabric: str
    fabric_reason: str
    devices: List[Device]
    limits: Optional[Limits]
    uptime: float
    data_address: str
    regions: int
    registered_bytes: int
    fallback: str

    @staticmethod
    def from_pb(i):
        """From its protobuf message."""
        fabrics = {pb.FABRIC_KIND_TCP: "tcp", pb.FABRIC_KIND_VERBS: "verbs"}
        devices = [Device(d.name, d.port, d.state, d.link_layer, d.active_mtu,
                          d.numa_node if d.HasField("numa_node") else None, d.pci_address or None,
                          d.speed_mbps or None, d.netdev or None) for d in i.devices]
        lim = i.limits if i.HasField("limits") else None
        limits = lim and Limits(lim.memlock_soft, lim.memlock_hard, lim.cap_ipc_lock, lim.max_regions,
                                lim.max_registered_bytes, lim.max_transfers)
        return AgentInfo(i.node_name, i.version, fabrics.get(i.fabric, "unknown"), i.fabric_reason, devices, limits,
                         i.uptime.ToTimedelta().total_seconds(), i.data_address, i.regions, i.registered_bytes, i.fallback)


def op_pb(op):
    if op not in (WRITE, READ):
        raise ValueError(f"op must be {WRITE!r} or {READ!r}, not {op!r}")
    return pb.OP_WRITE if op == WRITE else pb.OP_READ


def options_pb(qps=None, depth=None, chunk_size=None, timeout=None, verify=False):
    o = pb.TransferOptions(qps=qps or 0, depth=depth or 0, chunk_size=chunk_size or 0, verify=verify)
    if timeout:
        o.timeout.FromNanoseconds(int(timeout * 1e9))
    return o


def submit_pb(op, local, peer, remote, *, segments=None, notify=None, local_offset=0, remote_offset=0, length=None, **opts):
    """``length`` None: the rest of the source range; 0 is sent, and refused by the agent."""
    r = pb.SubmitTransferRequest(
        op=op_pb(op),
        local=pb.LocalRange(region=local, offset=local_offset),
        remote=pb.RemoteRange(agent=peer, region=remote, offset=remote_offset),
        options=options_pb(**opts),
        segments=[s.to_pb() for s in (segments or [])],
        notify=notify,
    )
    if length is not None:
        r.length = length
    return r


def create_pb(name, length, kind="anonymous", path="", access="rw", create=False):
    kinds = {"anonymous": pb.REGION_KIND_ANONYMOUS, "file": pb.REGION_KIND_FILE, "shm": pb.REGION_KIND_SHM}
    accesses = {"r": pb.ACCESS_READ, "w": pb.ACCESS_WRITE, "rw": pb.ACCESS_READ_WRITE}
    if kind not in kinds or access not in accesses:
        raise ValueError(f"kind must be one of {sorted(kinds)} and access one of {sorted(accesses)}")
    return pb.CreateRegionRequest(name=name, length=length, kind=kinds[kind], path=path, access=accesses[access], create_file=create)


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
