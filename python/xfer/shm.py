"""Shared-memory regions mapped into this process: the agent creates (and registers) the object
under /dev/shm, this process maps the same object, and the bytes written here are the bytes the
agent moves, with no copy through gRPC. ``buffer`` is a memoryview of the mapping and ``array()``
a NumPy uint8 array over it (when NumPy is installed): both are live views of memory that the
agent's NIC and peers may change at any time, so read them after a notification says a batch
landed, and do not write a range a transfer is reading."""
import mmap
import os

from xfer.errors import FailedPrecondition, InvalidArgument

SHM_DIR = "/dev/shm"


class ShmRegion:
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
        finally:
            os.close(fd)
        self.buffer = memoryview(self._mm)

    @property
    def name(self):
        return self.region.name

    def __len__(self):
        return self.region.length

    def array(self):
        """A NumPy uint8 array over the mapping (no copy)."""
        import numpy

        return numpy.frombuffer(self._mm, dtype=numpy.uint8)

    def write(self, offset, data):
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > len(self):
            raise InvalidArgument(f"{offset}+{len(view)} is outside region {self.name!r} ({len(self)} bytes)")
        self.buffer[offset:offset + len(view)] = view

    def read(self, offset, length):
        if offset < 0 or length < 0 or offset + length > len(self):
            raise InvalidArgument(f"{offset}+{length} is outside region {self.name!r} ({len(self)} bytes)")
        return bytes(self.buffer[offset:offset + length])

    def close(self):
        """Unmaps (views taken from ``buffer`` or ``array()`` must be released first)."""
        self.buffer.release()
        self._mm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
