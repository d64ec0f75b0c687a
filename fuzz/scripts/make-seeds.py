#!/usr/bin/env python3
"""Regenerates the committed seed corpora (fuzz/corpus/<target>/seed-*): valid TCP-fabric frame
streams for frame_decode, and selector byte + encoded protobuf for request_validation."""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "corpus")

# ---- frames (crates/xfer-engine/src/frame.rs); tokens and BASE as in fuzz_targets/frame_decode.rs
MAGIC = 0x31524658
WRITE, READ_REQ, READ_RESP, ACK, NAK = 1, 2, 3, 4, 5
BASE = 0x10000
WTOK, RTOK = b"\x11" * 16, b"\x22" * 16


def hdr(kind, id_, addr=0, ln=0, token=b"\0" * 16, flags=0, status=0):
    return struct.pack("<IBBHQQI16s", MAGIC, kind, flags, status, id_, addr, ln, token)


frames = {
    "seed-write-ack": hdr(WRITE, 1, BASE + 4096, 16, WTOK, flags=1) + bytes(range(16)),
    "seed-write-then-read": hdr(WRITE, 2, BASE + 8192, 8, WTOK) + b"payload!" + hdr(READ_REQ, 3, BASE + 8192, 8, RTOK),
    "seed-read": hdr(READ_REQ, 4, BASE, 64, RTOK),
    "seed-write-denied": hdr(WRITE, 5, BASE, 4, b"\x99" * 16, flags=1) + b"nope" + hdr(READ_REQ, 6, BASE, 4, WTOK),
    "seed-write-past-region": hdr(WRITE, 7, BASE + (62 << 10), 4096, b"\x33" * 16, flags=1),
    "seed-ack": hdr(ACK, 8),
    "seed-nak": hdr(NAK, 9, status=10),
    "seed-read-resp": hdr(READ_RESP, 10, ln=4) + b"data",
}

# ---- protobuf (proto/xfer/v1/xfer.proto), hand-encoded


def varint(n):
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def f_varint(field, n):
    return varint(field << 3) + varint(n)


def f_bytes(field, b):
    if isinstance(b, str):
        b = b.encode()
    return varint(field << 3 | 2) + varint(len(b)) + b


def duration(s, n=0):
    return f_varint(1, s) + (f_varint(2, n) if n else b"")


verbs_ep = f_bytes(1, f_varint(1, 17) + f_varint(2, 0x123456) + f_bytes(3, bytes(16)) + f_varint(4, 1)
                   + f_varint(6, 1) + f_varint(7, 4096) + f_varint(8, 16) + f_bytes(9, "RoCEv2") + f_bytes(10, "Ethernet"))
tcp_ep = f_bytes(2, f_bytes(1, "127.0.0.1:7001"))

requests = {
    # 0: CreateRegionRequest
    "seed-create-region": b"\x00" + f_bytes(1, "weights-0.bin") + f_varint(2, 1 << 20) + f_varint(3, 1)
    + f_varint(5, 3) + f_bytes(7, duration(3600)) + f_bytes(8, f_bytes(1, "team") + f_bytes(2, "ml")),
    "seed-create-region-file": b"\x00" + f_bytes(1, "ckpt") + f_varint(2, 4096) + f_varint(3, 2) + f_bytes(4, "/data/ckpt") + f_varint(5, 1),
    # 1: SubmitTransferRequest
    "seed-submit": b"\x01" + f_varint(1, 1) + f_bytes(2, f_bytes(1, "src") + f_varint(2, 0))
    + f_bytes(3, f_bytes(1, "10.0.0.2:7000") + f_bytes(2, "dst") + f_varint(3, 4096)) + f_varint(4, 65536)
    + f_bytes(5, f_varint(1, 1 << 20) + f_varint(2, 4) + f_varint(3, 32) + f_varint(4, 1) + f_bytes(5, duration(30, 500)) + f_varint(6, 2)),
    # 2: GrantRequest
    "seed-grant": b"\x02" + f_bytes(1, "dst") + f_varint(2, 0) + f_varint(3, 4096) + f_varint(4, 2)
    + f_bytes(5, duration(90)) + f_bytes(6, "node-a") + f_bytes(7, "conn-1"),
    # 3: PeerConnectRequest
    "seed-peer-connect-verbs": b"\x03" + f_varint(1, 1) + f_bytes(2, "node-a") + f_varint(3, 2) + f_bytes(4, verbs_ep) + f_bytes(4, verbs_ep) + f_bytes(5, "c1"),
    "seed-peer-connect-tcp": b"\x03" + f_varint(1, 1) + f_bytes(2, "node-a") + f_varint(3, 1) + f_bytes(4, tcp_ep) + f_bytes(5, "c2"),
    # 4: Endpoint
    "seed-endpoint-verbs": b"\x04" + verbs_ep,
    "seed-endpoint-tcp": b"\x04" + tcp_ep,
    # 5: Duration, 6: Timestamp
    "seed-duration": b"\x05" + duration(5, 250_000_000),
    "seed-timestamp": b"\x06" + f_varint(1, 1_700_000_000) + f_varint(2, 42),
    # 7: enum values (first 4 bytes) and text (parse_size / validate_name)
    "seed-size": b"\x07" + b"64MiB",
    "seed-name": b"\x07" + b"weights-0.bin",
    "seed-enum": b"\x07" + struct.pack("<i", 2),
    # Regression: a ttl of i64::MAX seconds overflowed SystemTime::now() + ttl (fixed in convert.rs).
    "seed-regress-huge-ttl": b"\x00" + f_bytes(1, "r") + f_varint(2, 1) + f_bytes(7, duration((1 << 63) - 1)),
}

for target, seeds in (("frame_decode", frames), ("request_validation", requests)):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
