"""Real agents for the tests: the workspace's xfer-agent binary (XFER_AGENT, default
../target/debug/xfer-agent, which `make test` builds first) on loopback over the tcp fabric, each
with its own state directory, ready when its ready file appears."""
import json
import os
import pathlib
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def agent_bin():
    p = pathlib.Path(os.environ.get("XFER_AGENT", ROOT / "target" / "debug" / "xfer-agent"))
    if not p.exists():
        pytest.fail(f"{p} missing: run `cargo build --workspace --bins` first (make test does)")
    return p


class Agent:
    def __init__(self, name, tmp):
        ready = tmp / f"{name}.ready"
        # Every test agent also serves its local unix socket.
        self.unix = f"unix://{tmp / (name + '.sock')}"
        env = dict(os.environ, XFER_UNIX_LISTEN=str(tmp / f"{name}.sock"))
        self.log = open(tmp / f"{name}.log", "wb")
        self.proc = subprocess.Popen(
            [str(agent_bin()), "--node-name", name, "--fabric", "tcp", "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--state-dir", str(tmp / name), "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        # A hang guard, not a synchronisation: readiness is the file the agent writes.
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent {name} did not start: {(tmp / f'{name}.log').read_text()}")
            time.sleep(0.01)
        bound = json.loads(ready.read_text())
        self.addr, self.metrics = bound["grpc"], bound["metrics"]
        self.state_dir = tmp / name

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture
def agents(tmp_path):
    a, b = Agent("prefill", tmp_path), Agent("decode", tmp_path)
    yield a, b
    a.stop()
    b.stop()
