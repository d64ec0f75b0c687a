"""Shared-memory regions mapped into this process: the agent creates (and registers) the object
under /dev/shm, this process maps the same object, and the bytes written here are the bytes the
agent moves, with no copy through gRPC. ``buffer`` is a memoryview of the mapping and ``array()``
a NumPy uint8 array over it (when NumPy is installed): both are live views of memory that the
agent's NIC and peers may change at any time, so read them after a notification says a batch
landed, and do not write a range a transfer is reading.

``read`` and ``write`` go through the object's file descriptor (``pread``/``pwrite``), not the
mapping: if the object is truncated under this process (by anyone who may write it), they raise
``FailedPrecondition`` instead of the process dying of SIGBUS. The live views cannot be guarded
that way; a process that shares the object with writers it does not trust should use
``read``/``write``."""
import mmap
import os

from xfer.errors import FailedPrecondition, InvalidArgument

SHM_DIR = "/dev/shm"


class ShmRegion:
    """A shared-memory region mapped into this process (``Client.create_shm_region``,
    ``Client.map_shm_region``): ``buffer`` and ``array()`` are live views, ``read``/``write`` go
    through the object's descriptor."""

    def __repr__(self):
        r = self.region
        state = "closed" if getattr(self, "_mm", None) is None or self._mm.closed else "mapped"
        return f"<xfer.ShmRegion {r.name!r} {r.length} bytes at /dev/shm/{r.path} ({state})>"

    def __init__(self, region):
        if region.kind != "shm":
            raise InvalidArgument(f"region {region.name!r} is not a shared-memory region")
        # An object name, never a path: the agent's own rule, checked again here.
        if not region.path or "/" in region.path or region.path.startswith("."):
            raise FailedPrecondition(f"shared-memory object name {region.path!r}")
        self.region = region
        path = os.path.join(SHM_DIR, region.path)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size < region.length:
                raise FailedPrecondition(f"{path} is {size} bytes, the region {region.length}")
            self._mm = mmap.mmap(fd, region.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        # Kept for read/write: pread and pwrite on a truncated object return short, never SIGBUS.
        self._fd = fd
        self.buffer = memoryview(self._mm)

    @property
    def name(self):
        """The region's name."""
        return self.region.name

    def __len__(self):
        return self.region.length

    def array(self):
        """A NumPy uint8 array over the mapping (no copy)."""
        import numpy

        return numpy.frombuffer(self._mm, dtype=numpy.uint8)

    def write(self, offset, data):
        """Writes ``data`` at ``offset`` through the object's descriptor (``FailedPrecondition``,
        not SIGBUS, if the object was truncated)."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > len(self):
            raise InvalidArgument(f"{offset}+{len(view)} is outside region {self.name!r} ({len(self)} bytes)")
        self._check_size(offset + len(view))
        done = 0
        while done < len(view):
            n = os.pwrite(self._fd, view[done:], offset + done)
            if n <= 0:
                raise FailedPrecondition(f"writing region {self.name!r} at {offset + done}: the object took no bytes")
            done += n
        # pwrite past a shrunken object's end would have grown it back: check again.
        self._check_size(offset + len(view))

    def read(self, offset, length):
        """Reads ``length`` bytes at ``offset`` through the object's descriptor."""
        if offset < 0 or length < 0 or offset + length > len(self):
            raise InvalidArgument(f"{offset}+{length} is outside region {self.name!r} ({len(self)} bytes)")
        self._check_size(offset + length)
        out = bytearray()
        while len(out) < length:
            chunk = os.pread(self._fd, length - len(out), offset + len(out))
            if not chunk:
                raise FailedPrecondition(
                    f"region {self.name!r}'s shared-memory object was truncated under this process "
                    f"({offset + len(out)} bytes readable of {offset + length} asked)"
                )
            out += chunk
        return bytes(out)

    def _check_size(self, end):
        size = os.fstat(self._fd).st_size
        if size < end:
            raise FailedPrecondition(
                f"region {self.name!r}'s shared-memory object was truncated under this process "
                f"(it has {size} bytes, the region {len(self)})"
            )

    def close(self):
        """Unmaps (views taken from ``buffer`` or ``array()`` must be released first)."""
        self.buffer.release()
        self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
