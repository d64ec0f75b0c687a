"""What a newcomer meets first, against real agents: TLS files given as paths (as xferctl takes
them) or bytes, connection errors that say what to change (xferctl's hints), ``info()`` as a typed
object, a readable ``ShmRegion``, a zero length refused rather than read as "everything", file
regions sized from their file or created, and a docstring on every public method."""
import ast
import os
import pathlib
import socket
import subprocess

import pytest

import xfer
from xfer._sync import pem
from xfer.types import AgentInfo


@pytest.fixture(scope="module")
def ca_pem(tmp_path_factory):
    d = tmp_path_factory.mktemp("ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"), "-days", "1", "-subj", "/CN=test-ca"],
                   check=True, capture_output=True)
    return d / "ca.crt"


def test_tls_files_are_paths_or_bytes(ca_pem, tmp_path):
    data = ca_pem.read_bytes()
    assert pem(str(ca_pem), "ca") == data
    assert pem(ca_pem, "ca") == data                      # os.PathLike
    assert pem(data, "ca") == data
    assert pem(data.decode(), "ca") == data               # PEM text
    assert pem(None, "ca") is None
    with pytest.raises(xfer.InvalidArgument, match="ca=.*missing.crt"):
        pem(str(tmp_path / "missing.crt"), "ca")
    with pytest.raises(TypeError):
        pem(42, "ca")
    with pytest.raises(xfer.InvalidArgument, match="go together"):
        xfer.Client("127.0.0.1:1", ca=ca_pem, cert=ca_pem)


def test_connection_errors_say_what_to_change(agents, ca_pem):
    a, _ = agents
    # TLS (a CA given as a path) to a plaintext agent.
    with xfer.Client(a.addr, ca=ca_pem) as c, pytest.raises(xfer.Unavailable, match="speaks plaintext"):
        c.info()
    # The metrics port is HTTP/1, not the agent's gRPC port.
    with xfer.Client(a.metrics.replace("0.0.0.0", "127.0.0.1")) as c, pytest.raises(xfer.Unavailable, match="metrics/health port"):
        c.info()
    # Nobody listens.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    with xfer.Client(closed) as c, pytest.raises(xfer.Unavailable, match="no agent listens there"):
        c.info()


def test_info_is_typed_and_shm_regions_read_well(agents):
    a, _ = agents
    with xfer.Client(a.addr) as c:
        info = c.info()
        assert isinstance(info, AgentInfo)
        assert (info.node_name, info.fabric, info.devices) == ("prefill", "tcp", [])
        assert info.limits.max_regions > 0 and info.uptime >= 0
        assert "prefill" in repr(info)
        assert repr(c) == f"xfer.Client({a.addr!r})"
        name = f"shm-{os.getpid()}"
        with c.create_shm_region(name, 1 << 20) as shm:
            r = repr(shm)
            assert r.startswith("<xfer.ShmRegion") and name in r and "1048576 bytes" in r and "mapped" in r, r
        assert "closed" in repr(shm)


def test_zero_length_is_refused_and_no_length_is_the_rest(agents):
    a, b = agents
    with xfer.Client(a.addr) as c, xfer.Client(b.addr) as d:
        c.create_region("src", 1 << 16)
        d.create_region("dst", 1 << 16)
        c.put("src", 0, bytes(range(256)) * 256)
        with pytest.raises(xfer.InvalidArgument, match="zero-length"):
            c.submit(xfer.WRITE, "src", b.addr, "dst", length=0)
        assert d.get("dst", 0, 1 << 16) == bytes(1 << 16), "a refused transfer moved nothing"
        t = c.transfer(xfer.WRITE, "src", b.addr, "dst", local_offset=1 << 15)
        assert t.length == 1 << 15
        assert d.get("dst", 0, 1 << 15) == (bytes(range(256)) * 256)[1 << 15:]


def test_file_regions_from_their_file_or_created(agents):
    a, _ = agents
    root = a.state_dir / "files"
    (root / "w.bin").write_bytes(b"w" * 12345)
    with xfer.Client(a.addr) as c:
        assert c.create_region("w", 0, kind="file", path="w.bin").length == 12345
        assert c.create_region("n", 8192, kind="file", path="new.bin", create=True).length == 8192
        assert (root / "new.bin").stat().st_size == 8192
        with pytest.raises(xfer.AlreadyExists):
            c.create_region("again", 4096, kind="file", path="w.bin", create=True)
        assert (root / "w.bin").read_bytes() == b"w" * 12345


def test_every_public_method_has_a_docstring():
    missing = []
    for f in sorted(pathlib.Path(xfer.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                if not ast.get_docstring(node):
                    missing.append(f"{f.name}: class {node.name}")
                for m in node.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("_") \
                            and not ast.get_docstring(m):
                        missing.append(f"{f.name}: {node.name}.{m.name}")
    assert not missing, missing
