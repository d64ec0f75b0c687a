"""Typed errors: every gRPC status the agent returns becomes a subclass of XferError to catch,
plus TransferFailed and BatchFailed for work that ended without succeeding."""
import grpc


class XferError(Exception):
    """Base of every error this package raises. ``code`` is the gRPC status name (or the
    transfer's / batch's error code)."""

    code = "UNKNOWN"

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(XferError):
    """A range, size, name or other argument the agent (or this client) refused."""

    code = "INVALID_ARGUMENT"


class NotFound(XferError):
    """No such region, transfer or peer."""

    code = "NOT_FOUND"


class AlreadyExists(XferError):
    """A region (or file, shm object) of that name exists."""

    code = "ALREADY_EXISTS"


class PermissionDenied(XferError):
    """The caller's role, or a region's access ceiling, forbids it."""

    code = "PERMISSION_DENIED"


class Unauthenticated(XferError):
    """No usable client identity."""

    code = "UNAUTHENTICATED"


class ResourceExhausted(XferError):
    """A limit of the agent (regions, bytes, transfers, segments, subscribers)."""

    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(XferError):
    """Valid, but not now: a busy or unavailable region, an expired grant, no huge pages."""

    code = "FAILED_PRECONDITION"


class Unavailable(XferError):
    """The agent or its peer cannot be reached; the message says why when it can tell."""

    code = "UNAVAILABLE"


class Aborted(XferError):
    """Work the agent gave up."""

    code = "ABORTED"


class DeadlineExceeded(XferError):
    """A deadline passed."""

    code = "DEADLINE_EXCEEDED"


class DataLoss(XferError):
    """A notification reader fell too far behind."""

    code = "DATA_LOSS"


class Cancelled(XferError):
    """Cancelled."""

    code = "CANCELLED"


class OutOfRange(XferError):
    """A range past an end."""

    code = "OUT_OF_RANGE"


class TransferFailed(XferError):
    """A transfer that ended FAILED or CANCELLED; ``code`` is its ``error_code``."""

    def __init__(self, transfer):
        super().__init__(f"transfer {transfer.id} {transfer.state}: {transfer.error} ({transfer.error_code})", transfer.error_code)
        self.transfer = transfer


class BatchFailed(XferError):
    """A channel batch the agent answered with a failure: INVALID_ARGUMENT, RESOURCE_EXHAUSTED or
    NOT_FOUND for a refused batch (the channel goes on), a transfer failure code otherwise."""

    def __init__(self, seq, code, message):
        super().__init__(f"batch {seq} failed ({code}): {message}", code)
        self.seq = seq


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
}


def from_rpc(e, addr=None, tls=False, client_cert=False):
    """The XferError for a grpc.RpcError (or grpc.aio.AioRpcError). With the client's ``addr``
    (and whether it used TLS and a client certificate), a failed connection says what to change,
    as xferctl does (``xfer.diagnose``)."""
    code = e.code()
    cls = _BY_CODE.get(code, XferError)
    message = e.details() or str(code)
    if addr is not None and code == grpc.StatusCode.UNAVAILABLE:
        message = _connection_hint(addr, tls, client_cert, message)
    err = cls(message, None if cls is not XferError else code.name)
    err.__cause__ = e
    return err


def _connection_hint(addr, tls, client_cert, details):
    from xfer import diagnose

    explained = diagnose.explain(addr, tls, client_cert, details)
    if explained:
        return explained
    if "connection refused" in details.lower():
        return f"cannot connect to agent at {addr}: connection refused (no agent listens there: is xfer-agent running, on this address?)"
    return details
