"""The blocking client (``xfer.Client``) over grpc's synchronous stubs."""
import os
import queue

import grpc

from xfer import types as t
from xfer.errors import InvalidArgument, NotFound, TransferFailed, Unavailable, from_rpc
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


def pem(value, what):
    """PEM bytes from what a caller gave for ``what`` (``ca``, ``cert``, ``key``): bytes (the PEM
    itself), PEM text, or a path (``str`` or ``os.PathLike``) to read, as xferctl's ``--ca``,
    ``--cert`` and ``--key`` take; None stays None."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    if isinstance(value, (str, os.PathLike)):
        try:
            with open(value, "rb") as f:
                return f.read()
        except OSError as e:
            raise InvalidArgument(f"{what}={os.fspath(value)!r}: cannot read it: {e.strerror}") from None
    raise TypeError(f"{what} must be a path (str or os.PathLike) or PEM bytes, not {type(value).__name__}")


def make_channel(addr, ca=None, cert=None, key=None, server_name=None, aio=False):
    """A gRPC channel to ``addr`` (``host:port``, or ``unix:///path`` for the agent's local socket):
    plaintext, or TLS with the CA (and for mTLS this client's certificate and key): each a path
    or PEM bytes (see ``pem``)."""
    ca, cert, key = pem(ca, "ca"), pem(cert, "cert"), pem(key, "key")
    if (cert is None) != (key is None):
        raise InvalidArgument("cert= and key= go together: give both for mTLS (and ca=), or neither")
    if cert is not None and ca is None:
        raise InvalidArgument("cert= and key= need ca=, the CA the agent's certificate must chain to")
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
        """Ends the subscription."""
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
        """The next batch's ``BatchDone``, in the order they were sent (``BatchFailed`` raised)."""
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
        """Sends a batch of ``segments`` and waits for its ``BatchDone``."""
        self.send(segments, 0, notify)
        return self.done()

    def post_list(self, list_id, notify=None):
        """Sends the list prepared under ``list_id`` and waits for its ``BatchDone``."""
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
    """A blocking client of one agent.

    ``addr`` is ``host:port`` (or ``unix:///path``, the agent's local socket). Plaintext without
    ``ca``; with ``ca`` TLS, and with ``cert`` and ``key`` mTLS (which an agent with
    ``insecure = false`` requires). Each is a path (``str`` or ``os.PathLike``, as xferctl's
    ``--ca``/``--cert``/``--key``) or the PEM bytes; ``server_name`` overrides the name the agent's
    certificate is verified against. Errors are ``XferError`` subclasses; a failed connection
    says why (plaintext to an mTLS agent, the metrics port, a refused certificate...)."""

    def __init__(self, addr, *, ca=None, cert=None, key=None, server_name=None):
        self.addr = addr
        self._tls = (ca is not None, cert is not None)
        self._channel = make_channel(addr, ca, cert, key, server_name)
        self._stub = rpc.AgentStub(self._channel)

    def __repr__(self):
        return f"xfer.Client({self.addr!r}{', tls' if self._tls[0] else ''})"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except grpc.RpcError as e:
            raise from_rpc(e, self.addr, *self._tls) from None

    def close(self):
        """Closes the connection to the agent."""
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def info(self):
        """The agent's node, fabric, devices and limits, as an ``AgentInfo``."""
        return t.AgentInfo.from_pb(self._call(self._stub.GetInfo, pb.GetInfoRequest()))

    # regions
    def create_region(self, name, length, kind="anonymous", path="", access="rw", create=False):
        """Creates a region of ``length`` bytes and returns its ``Region``. ``kind``:
        ``"anonymous"`` (agent memory), ``"file"`` (the file ``path`` beneath the agent's
        ``regions.file_roots``; ``length`` 0 takes the file's size, ``create=True`` makes a new
        file) or ``"shm"`` (see ``create_shm_region``). ``access`` (``"rw"``, ``"r"``, ``"w"``)
        is what peers may do."""
        return t.Region.from_pb(self._call(self._stub.CreateRegion, t.create_pb(name, length, kind, path, access, create)))

    def region(self, name):
        """The ``Region`` named ``name`` (or with that id)."""
        return t.Region.from_pb(self._call(self._stub.GetRegion, pb.GetRegionRequest(name=name)))

    def regions(self):
        """Every region of the agent, as ``Region``s."""
        return [t.Region.from_pb(r) for r in self._call(self._stub.ListRegions, pb.ListRegionsRequest()).regions]

    def delete_region(self, name):
        """Deletes region ``name`` (refused while a transfer uses it)."""
        self._call(self._stub.DeleteRegion, pb.DeleteRegionRequest(name=name))

    def put(self, region, offset, data):
        """Writes ``data`` (bytes-like) into ``region`` at ``offset`` through the control plane;
        returns the bytes written."""
        return self._call(self._stub.WriteRegion, t.put_messages(region, offset, data)).bytes_written

    def get(self, region, offset, length):
        """Reads ``length`` bytes of ``region`` at ``offset`` through the control plane."""

        def read():
            return b"".join(m.data for m in self._stub.ReadRegion(pb.ReadRegionRequest(region=region, offset=offset, length=length)))

        return self._call(read)

    def create_shm_region(self, name, length):
        """Has the agent create a shared-memory region and maps it here."""
        return ShmRegion(self.create_region(name, length, kind="shm"))

    def map_shm_region(self, name):
        """Maps the existing shared-memory region ``name`` here (this process must be allowed to
        open its object)."""
        return ShmRegion(self.region(name))

    # transfers
    def submit(self, op, local, peer, remote, **kw):
        """Submits a transfer and returns its ``Transfer`` at once: ``op`` (``WRITE`` local into
        remote, ``READ`` remote into local) between region ``local`` here and region ``remote`` of
        the agent at ``peer``. Keywords: ``local_offset``, ``remote_offset``, ``length`` (omitted:
        the rest of the source; 0 is refused), ``segments=[Segment...]`` for a batch,
        ``notify=b"tag"``, and ``qps``, ``depth``, ``chunk_size``, ``timeout`` (seconds),
        ``verify``."""
        return t.Transfer.from_pb(self._call(self._stub.SubmitTransfer, t.submit_pb(op, local, peer, remote, **kw)))

    def wait(self, transfer_id):
        """Waits until the transfer ends; raises TransferFailed unless it succeeded."""
        def watch():
            last = None
            for m in self._stub.WatchTransfer(pb.WatchTransferRequest(id=transfer_id)):
                last = t.Transfer.from_pb(m)
                if last.state in t.TERMINAL:
                    return last
            return last

        tr = self._call(watch)
        if tr is None:
            raise NotFound(f"transfer {transfer_id}")
        if tr.state != "succeeded":
            raise TransferFailed(tr)
        return tr

    def transfer(self, op, local, peer, remote, **kw):
        """``submit`` then ``wait``: the finished ``Transfer``, or ``TransferFailed``."""
        return self.wait(self.submit(op, local, peer, remote, **kw).id)

    def cancel(self, transfer_id):
        """Cancels a transfer; its ``Transfer`` as it stands."""
        return t.Transfer.from_pb(self._call(self._stub.CancelTransfer, pb.CancelTransferRequest(id=transfer_id)))

    # notifications and channels
    def watch_inbound(self, region=None, tag=None):
        """Subscribes to this agent's notifications (one region or all, one tag or all); iterate
        the result. Subscribed once this returns: batches that land from now on are seen."""
        stream = self._stub.WatchInbound(pb.WatchInboundRequest(region=region or "", tag=tag))
        # The agent answers with headers once it has subscribed.
        self._call(stream.initial_metadata)
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
        """Opens a ``Channel``: one connection and one grant on ``remote`` (``offset``/``length``
        keywords bound it), then many batches (``post``, ``prepare``/``post_list``)."""
        try:
            return Channel(self._stub, t.channel_open_pb(op, local, peer, remote, **kw))
        except grpc.RpcError as e:
            raise from_rpc(e) from None
