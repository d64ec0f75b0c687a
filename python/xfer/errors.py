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
    code = "INVALID_ARGUMENT"


class NotFound(XferError):
    code = "NOT_FOUND"


class AlreadyExists(XferError):
    code = "ALREADY_EXISTS"


class PermissionDenied(XferError):
    code = "PERMISSION_DENIED"


class Unauthenticated(XferError):
    code = "UNAUTHENTICATED"


class ResourceExhausted(XferError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(XferError):
    code = "FAILED_PRECONDITION"


class Unavailable(XferError):
    code = "UNAVAILABLE"


class Aborted(XferError):
    code = "ABORTED"


class DeadlineExceeded(XferError):
    code = "DEADLINE_EXCEEDED"


class DataLoss(XferError):
    code = "DATA_LOSS"


class Cancelled(XferError):
    code = "CANCELLED"


class OutOfRange(XferError):
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


def from_rpc(e):
    """The XferError for a grpc.RpcError (or grpc.aio.AioRpcError)."""
    code = e.code()
    cls = _BY_CODE.get(code, XferError)
    err = cls(e.details() or str(code), None if cls is not XferError else code.name)
    err.__cause__ = e
    return err
