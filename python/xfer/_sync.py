"""The blocking client (``xfer.Client``) over grpc's synchronous stubs."""
import queue

import grpc

from xfer import types as t
from xfer.errors import NotFound, TransferFailed, Unavailable, from_rpc
from xfer.ring import Ring
from xfer.shm import ShmRegion
from xfer.v1 import xfer_pb2 as pb
from xfer.v1 import xfer_pb2_grpc as rpc

MAX_MESSAGE = 64 << 20
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]


def _call(fn, *args):
    try:
        return fn(*args)
    except grpc.RpcError as e:
        raise from_rpc(e) from None


def make_channel(addr, ca=None, cert=None, key=None, server_name=None, aio=False):
    """A gRPC channel to ``addr`` (``host:port``, or ``unix:///path`` for the agent's local socket):
    plaintext, or TLS with the CA (and for mTLS this client's certificate and key), all PEM bytes."""
    mod = grpc.aio if aio else grpc
    if addr.startswith("unix:"):
        # The agent's local socket: no TLS (callers are known by uid). gRPC would send the socket
        # path as :authority, which is not a valid HTTP/2 authority; name the local host instead.
        if ca is not None:
            raise ValueError("the unix socket has no TLS: the agent knows its callers by uid")
        return mod.insecure_channel(addr, options=_CHANNEL_OPTIONS + [("grpc.default_authority", "localhost")])
    if ca is None:
        return mod.insecure_channel(addr, options=_CHANNEL_OPTIONS)
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    opts = list(_CHANNEL_OPTIONS) + ([("grpc.ssl_target_name_override", server_name)] if server_name else [])
    return mod.secure_channel(addr, creds, options=opts)


class Inbound:
    """Notifications of this agent, as they are published."""

    def __init__(self, stream):
        self._stream = stream

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return t.Notification.from_pb(next(self._stream))
        except grpc.RpcError as e:
            raise from_rpc(e) from None
        except StopIteration:
            raise Unavailable("the notification stream ended") from None

    def cancel(self):
        self._stream.cancel()


class Channel:
    """One connection and one grant held by the agent; batches posted one after another."""

    def __init__(self, stub, open_req):
        self._q = queue.Queue()
        self._q.put(open_req)
        self._events = stub.OpenChannel(iter(self._q.get, None))
        self._seq = 0
        # Batches sent whose answers were not read off the stream yet, and answers read ahead of
        # done() by prepare() (the agent answers in request order), oldest first.
        self._unanswered = 0
        self._early = []
        ev = self._next()
        if ev.WhichOneof("ev") != "opened":
            raise Unavailable(f"expected ChannelOpened, got {ev}")
        self.id = ev.opened.channel_id
        self.range = (ev.opened.remote_offset, ev.opened.remote_length)
        self.qps = ev.opened.qps

    def _next(self):
        try:
            return next(self._events)
        except grpc.RpcError as e:
            raise from_rpc(e) from None
        except StopIteration:
            raise Unavailable("the channel ended") from None

    def prepare(self, list_id, segments):
        """Checks and keeps ``segments`` under ``list_id`` (1..64) for ``post_list``. Answers to
        batches sent before it are kept for ``done()``."""
        self._q.put(t.channel_prepare_pb(list_id, segments))
        while self._unanswered > 0:
            ev = self._next()
            if ev.WhichOneof("ev") != "done":
                raise Unavailable(f"expected the BatchDone of a batch sent earlier, got {ev}")
            self._unanswered -= 1
            self._early.append(ev)
        ev = self._next()
        if ev.WhichOneof("ev") == "done":
            raise t.batch_done(ev)
        return ev.prepared.segments

    def send(self, segments=None, list_id=0, notify=None):
        """Queues a batch; its answer comes from ``done()``, in order. Returns its number."""
        seq = self._seq
        self._seq += 1
        self._q.put(t.channel_post_pb(seq, segments, list_id, notify))
        self._unanswered += 1
        return seq

    def done(self):
        if self._early:
            ev = self._early.pop(0)
        else:
            ev = self._next()
            self._unanswered = max(0, self._unanswered - 1)
        r = t.batch_done(ev)
        if isinstance(r, Exception):
            raise r
        return r

    def post(self, segments, notify=None):
        self.send(segments, 0, notify)
        return self.done()

    def post_list(self, list_id, notify=None):
        self.send(None, list_id, notify)
        return self.done()

    def close(self):
        """Ends the channel once the batches sent have run."""
        self._q.put(None)
        try:
            for _ in self._events:
                pass
        except grpc.RpcError as e:
            raise from_rpc(e) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client:
    """A blocking client of one agent."""

    def __init__(self, addr, *, ca=None, cert=None, key=None, server_name=None):
        self.addr = addr
        self._channel = make_channel(addr, ca, cert, key, server_name)
        self._stub = rpc.AgentStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def info(self):
        return _call(self._stub.GetInfo, pb.GetInfoRequest())

    # regions
    def create_region(self, name, length, kind="anonymous", path="", access="rw"):
        return t.Region.from_pb(_call(self._stub.CreateRegion, t.create_pb(name, length, kind, path, access)))

    def region(self, name):
        return t.Region.from_pb(_call(self._stub.GetRegion, pb.GetRegionRequest(name=name)))

    def regions(self):
        return [t.Region.from_pb(r) for r in _call(self._stub.ListRegions, pb.ListRegionsRequest()).regions]

    def delete_region(self, name):
        _call(self._stub.DeleteRegion, pb.DeleteRegionRequest(name=name))

    def put(self, region, offset, data):
        return _call(self._stub.WriteRegion, t.put_messages(region, offset, data)).bytes_written

    def get(self, region, offset, length):
        def read():
            return b"".join(m.data for m in self._stub.ReadRegion(pb.ReadRegionRequest(region=region, offset=offset, length=length)))

        return _call(read)

    def create_shm_region(self, name, length):
        """Has the agent create a shared-memory region and maps it here."""
        return ShmRegion(self.create_region(name, length, kind="shm"))

    def map_shm_region(self, name):
        return ShmRegion(self.region(name))

    # transfers
    def submit(self, op, local, peer, remote, **kw):
        """Submits a transfer (``segments=[Segment...]`` for a batch, ``notify=b"tag"``)."""
        return t.Transfer.from_pb(_call(self._stub.SubmitTransfer, t.submit_pb(op, local, peer, remote, **kw)))

    def wait(self, transfer_id):
        """Waits until the transfer ends; raises TransferFailed unless it succeeded."""
        def watch():
            last = None
            for m in self._stub.WatchTransfer(pb.WatchTransferRequest(id=transfer_id)):
                last = t.Transfer.from_pb(m)
                if last.state in t.TERMINAL:
                    return last
            return last

        tr = _call(watch)
        if tr is None:
            raise NotFound(f"transfer {transfer_id}")
        if tr.state != "succeeded":
            raise TransferFailed(tr)
        return tr

    def transfer(self, op, local, peer, remote, **kw):
        return self.wait(self.submit(op, local, peer, remote, **kw).id)

    def cancel(self, transfer_id):
        return t.Transfer.from_pb(_call(self._stub.CancelTransfer, pb.CancelTransferRequest(id=transfer_id)))

    # notifications and channels
    def watch_inbound(self, region=None, tag=None):
        """Subscribes to this agent's notifications (one region or all, one tag or all); iterate
        the result. Subscribed once this returns: batches that land from now on are seen."""
        stream = self._stub.WatchInbound(pb.WatchInboundRequest(region=region or "", tag=tag))
        # The agent answers with headers once it has subscribed.
        _call(stream.initial_metadata)
        return Inbound(stream)

    def watch_inbound_ring(self, region=None, tag=None, slots=0):
        """Subscribes like ``watch_inbound``, through a shared-memory ring the agent writes and this
        process maps (x86-64 only; see ``xfer.ring``): ``ring.next(timeout)`` / ``try_next()``.
        ``slots``: a power of two, 16..65536 (0: the agent's 1024). Subscribed once this returns;
        closing the ring ends the subscription and the agent removes the object."""
        call = self._stub.WatchInboundRing(t.watch_inbound_ring_pb(region, tag, slots))
        try:
            info = t.RingInfo.from_pb(next(call))
        except grpc.RpcError as e:
            raise from_rpc(e) from None
        except StopIteration:
            raise Unavailable("WatchInboundRing ended without naming a ring") from None
        try:
            return Ring(info.object, info.length, call=call, expect=info)
        except BaseException:
            call.cancel()
            raise

    def open_channel(self, op, local, peer, remote, **kw):
        try:
            return Channel(self._stub, t.channel_open_pb(op, local, peer, remote, **kw))
        except grpc.RpcError as e:
            raise from_rpc(e) from None
