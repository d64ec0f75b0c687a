"""The asyncio client (``xfer.AsyncClient``) over grpc.aio: the same operations as the blocking
one, as coroutines."""
import grpc

from xfer import types as t
from xfer._sync import make_channel
from xfer.errors import NotFound, TransferFailed, Unavailable, from_rpc
from xfer.ring import AsyncRing
from xfer.shm import ShmRegion
from xfer.v1 import xfer_pb2 as pb
from xfer.v1 import xfer_pb2_grpc as rpc


async def _call(coro):
    try:
        return await coro
    except grpc.aio.AioRpcError as e:
        raise from_rpc(e) from None


class AsyncInbound:
    """Notifications of this agent, as they are published (``async for``, or ``await next()``)."""

    def __init__(self, call):
        self._call = call

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.next()

    async def next(self):
        """The next ``Notification``."""
        m = await _call(self._call.read())
        if m is grpc.aio.EOF:
            raise Unavailable("the notification stream ended")
        return t.Notification.from_pb(m)

    def cancel(self):
        """Ends the subscription."""
        self._call.cancel()


class AsyncChannel:
    """One connection and one grant held by the agent; batches posted one after another."""

    def __init__(self, call, opened):
        self._call = call
        self._seq = 0
        # Batches sent whose answers were not read off the stream yet, and answers read ahead of
        # done() by prepare() (the agent answers in request order), oldest first.
        self._unanswered = 0
        self._early = []
        self.id = opened.channel_id
        self.range = (opened.remote_offset, opened.remote_length)
        self.qps = opened.qps

    @staticmethod
    async def open(stub, open_req):
        """Opens the channel ``open_req`` asks for (``AsyncClient.open_channel`` calls this)."""
        call = stub.OpenChannel()
        await _call(call.write(open_req))
        ev = await _call(call.read())
        if ev is grpc.aio.EOF or ev.WhichOneof("ev") != "opened":
            raise Unavailable(f"expected ChannelOpened, got {ev}")
        return AsyncChannel(call, ev.opened)

    async def _next(self):
        ev = await _call(self._call.read())
        if ev is grpc.aio.EOF:
            raise Unavailable("the channel ended")
        return ev

    async def prepare(self, list_id, segments):
        """``Channel.prepare``."""
        await _call(self._call.write(t.channel_prepare_pb(list_id, segments)))
        while self._unanswered > 0:
            ev = await self._next()
            if ev.WhichOneof("ev") != "done":
                raise Unavailable(f"expected the BatchDone of a batch sent earlier, got {ev}")
            self._unanswered -= 1
            self._early.append(ev)
        ev = await self._next()
        if ev.WhichOneof("ev") == "done":
            raise t.batch_done(ev)
        return ev.prepared.segments

    async def send(self, segments=None, list_id=0, notify=None):
        """``Channel.send``: queues a batch, returns its number."""
        seq = self._seq
        self._seq += 1
        await _call(self._call.write(t.channel_post_pb(seq, segments, list_id, notify)))
        self._unanswered += 1
        return seq

    async def done(self):
        """``Channel.done``: the next batch's ``BatchDone``, in order."""
        if self._early:
            ev = self._early.pop(0)
        else:
            ev = await self._next()
            self._unanswered = max(0, self._unanswered - 1)
        r = t.batch_done(ev)
        if isinstance(r, Exception):
            raise r
        return r

    async def post(self, segments, notify=None):
        """Sends a batch and waits for its ``BatchDone``."""
        await self.send(segments, 0, notify)
        return await self.done()

    async def post_list(self, list_id, notify=None):
        """Sends a prepared list and waits for its ``BatchDone``."""
        await self.send(None, list_id, notify)
        return await self.done()

    async def close(self):
        """Ends the channel once the batches sent have run."""
        await _call(self._call.done_writing())
        while True:
            ev = await _call(self._call.read())
            if ev is grpc.aio.EOF:
                return

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class AsyncClient:
    """An asyncio client of one agent (create it inside a running event loop): ``Client``'s
    operations and arguments (``ca``, ``cert``, ``key``: paths or PEM bytes), as coroutines."""

    def __init__(self, addr, *, ca=None, cert=None, key=None, server_name=None):
        self.addr = addr
        self._tls = (ca is not None, cert is not None)
        self._channel = make_channel(addr, ca, cert, key, server_name, aio=True)
        self._stub = rpc.AgentStub(self._channel)

    def __repr__(self):
        return f"xfer.AsyncClient({self.addr!r}{', tls' if self._tls[0] else ''})"

    async def _call(self, coro):
        try:
            return await coro
        except grpc.aio.AioRpcError as e:
            raise from_rpc(e, self.addr, *self._tls) from None

    async def close(self):
        """Closes the connection to the agent."""
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def info(self):
        """``Client.info``: an ``AgentInfo``."""
        return t.AgentInfo.from_pb(await self._call(self._stub.GetInfo(pb.GetInfoRequest())))

    async def create_region(self, name, length, kind="anonymous", path="", access="rw", create=False):
        """``Client.create_region``."""
        return t.Region.from_pb(await self._call(self._stub.CreateRegion(t.create_pb(name, length, kind, path, access, create))))

    async def region(self, name):
        """``Client.region``."""
        return t.Region.from_pb(await self._call(self._stub.GetRegion(pb.GetRegionRequest(name=name))))

    async def regions(self):
        """``Client.regions``."""
        return [t.Region.from_pb(r) for r in (await self._call(self._stub.ListRegions(pb.ListRegionsRequest()))).regions]

    async def delete_region(self, name):
        """``Client.delete_region``."""
        await self._call(self._stub.DeleteRegion(pb.DeleteRegionRequest(name=name)))

    async def put(self, region, offset, data):
        """``Client.put``."""
        return (await self._call(self._stub.WriteRegion(t.put_messages(region, offset, data)))).bytes_written

    async def get(self, region, offset, length):
        """``Client.get``."""
        call = self._stub.ReadRegion(pb.ReadRegionRequest(region=region, offset=offset, length=length))
        out = bytearray()
        while True:
            m = await self._call(call.read())
            if m is grpc.aio.EOF:
                return bytes(out)
            out += m.data

    async def create_shm_region(self, name, length):
        """``Client.create_shm_region``: a ``ShmRegion`` mapped here."""
        return ShmRegion(await self.create_region(name, length, kind="shm"))

    async def map_shm_region(self, name):
        """``Client.map_shm_region``."""
        return ShmRegion(await self.region(name))

    async def submit(self, op, local, peer, remote, **kw):
        """``Client.submit``: the ``Transfer`` at once."""
        return t.Transfer.from_pb(await self._call(self._stub.SubmitTransfer(t.submit_pb(op, local, peer, remote, **kw))))

    async def wait(self, transfer_id):
        """``Client.wait``: the finished ``Transfer``, or ``TransferFailed``."""
        call = self._stub.WatchTransfer(pb.WatchTransferRequest(id=transfer_id))
        last = None
        while True:
            m = await self._call(call.read())
            if m is grpc.aio.EOF:
                break
            last = t.Transfer.from_pb(m)
            if last.state in t.TERMINAL:
                break
        if last is None:
            raise NotFound(f"transfer {transfer_id}")
        if last.state != "succeeded":
            raise TransferFailed(last)
        return last

    async def transfer(self, op, local, peer, remote, **kw):
        """``submit`` then ``wait``."""
        return await self.wait((await self.submit(op, local, peer, remote, **kw)).id)

    async def cancel(self, transfer_id):
        """``Client.cancel``."""
        return t.Transfer.from_pb(await self._call(self._stub.CancelTransfer(pb.CancelTransferRequest(id=transfer_id))))

    async def watch_inbound(self, region=None, tag=None):
        """``Client.watch_inbound``: an ``AsyncInbound`` to ``async for`` over."""
        call = self._stub.WatchInbound(pb.WatchInboundRequest(region=region or "", tag=tag))
        # The agent answers with headers once it has subscribed.
        await self._call(call.initial_metadata())
        return AsyncInbound(call)

    async def watch_inbound_ring(self, region=None, tag=None, slots=0):
        """``Client.watch_inbound_ring``: an AsyncRing, whose ``next`` is a coroutine."""
        call = self._stub.WatchInboundRing(t.watch_inbound_ring_pb(region, tag, slots))
        try:
            m = await self._call(call.read())
            if m is grpc.aio.EOF:
                raise Unavailable("WatchInboundRing ended without naming a ring")
            info = t.RingInfo.from_pb(m)
            return AsyncRing(info.object, info.length, call=call, expect=info)
        except BaseException:
            call.cancel()
            raise

    async def open_channel(self, op, local, peer, remote, **kw):
        """``Client.open_channel``: an ``AsyncChannel``."""
        return await AsyncChannel.open(self._stub, t.channel_open_pb(op, local, peer, remote, **kw))


