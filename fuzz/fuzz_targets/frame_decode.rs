//! The TCP fabric's wire format, fed arbitrary bytes.
//!
//! 1. `Header::decode` on the first 44 bytes: total (never panics), and a decoded header respects
//!    its invariants and re-encodes to exactly the input bytes.
//! 2. The whole input as one data-connection byte stream into the target side's frame loop
//!    (`fabric::tcp::serve_frames`), in memory: no sockets. A fuzz-local grant table exposes a write
//!    window and a read window of a real `RegionMemory`. Whatever the stream holds, the loop must
//!    return (not panic) and everything it wrote back must be a well-formed stream of responses.
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use xfer_engine::ids::ConnectionId;
use xfer_fabric::frame::{Header, Kind, HEADER_LEN, MAX_PAYLOAD};
use xfer_fabric::grant::{self, AccessCheck, Checked, GrantGate};
use xfer_fabric::tcp::{read_hello, serve_frames};

/// The data connection the fuzzed stream belongs to.
const CONNECTION: &str = "fuzz-conn";

fn connection() -> ConnectionId {
    // Invariant: a constant valid id.
    ConnectionId::parse(CONNECTION).expect("valid id")
}
use xfer_fabric::{RemoteOp, WcStatus};
use xfer_rdma::memory::RegionMemory;

/// Remote address of region offset 0 (a fixed value so the fuzzer can reach the windows).
const BASE: u64 = 0x1_0000;
const REGION_LEN: usize = 64 << 10;
pub const WRITE_TOKEN: [u8; 16] = [0x11; 16];
pub const READ_TOKEN: [u8; 16] = [0x22; 16];

/// A grant: `len` bytes at region `offset`, for one operation.
struct Window {
    token: [u8; 16],
    op: RemoteOp,
    offset: u64,
    len: u64,
}

/// Mirrors `GrantTable::check`: token → grant, op, range with overflow checks, memory bounds.
struct FuzzGrants {
    memory: Arc<RegionMemory>,
    windows: Vec<Window>,
    /// Never revoked nor expired.
    gate: Arc<GrantGate>,
}

impl AccessCheck for FuzzGrants {
    fn check(&self, connection: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
        // Grants are bound to the data connection they were asked on.
        if connection.as_str() != CONNECTION {
            return Err(WcStatus::RemAccessErr);
        }
        let w = self.windows.iter().find(|w| &w.token == token).ok_or(WcStatus::RemAccessErr)?;
        // The window lets the stream check later frames under the token without asking (its
        // cache is fuzzed too).
        let window = grant::Window { op: w.op, start: BASE + w.offset, len: w.len, base: BASE };
        let offset = window.offset(addr, len, op)?;
        self.memory.check(offset, len).map_err(|_| WcStatus::RemAccessErr)?;
        Ok(Checked { memory: self.memory.clone(), offset, gate: self.gate.clone(), window: Some(window) })
    }

    fn marker(&self, connection: &ConnectionId, token: &[u8; 16], _imm: u32) -> Result<(), WcStatus> {
        if connection.as_str() != CONNECTION || !self.windows.iter().any(|w| &w.token == token) {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(())
    }
}

fn grants() -> &'static FuzzGrants {
    static G: OnceLock<FuzzGrants> = OnceLock::new();
    G.get_or_init(|| FuzzGrants {
        memory: Arc::new(RegionMemory::anonymous(REGION_LEN, false).expect("64 KiB anonymous mapping")),
        windows: vec![
            Window { token: WRITE_TOKEN, op: RemoteOp::Write, offset: 4096, len: 16 << 10 },
            Window { token: READ_TOKEN, op: RemoteOp::Read, offset: 0, len: REGION_LEN as u64 },
            // A window that ends past the region: the memory bounds check must still refuse.
            Window { token: [0x33; 16], op: RemoteOp::Write, offset: 60 << 10, len: 8 << 10 },
        ],
        gate: GrantGate::new(std::time::SystemTime::now() + std::time::Duration::from_secs(100 * 365 * 86_400)),
    })
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("tokio runtime"))
}

fn check_header(b: &[u8; HEADER_LEN]) {
    if let Ok(h) = Header::decode(b) {
        assert!(h.len <= MAX_PAYLOAD);
        assert!(h.payload_len() <= h.len);
        if matches!(h.kind, Kind::Ack | Kind::Nak | Kind::ReadReq) {
            assert_eq!(h.payload_len(), 0);
        }
        // Decoding keeps every field, so it is the exact inverse of encoding.
        assert_eq!(&h.encode(), b);
        assert_eq!(Header::decode(&h.encode()), Ok(h));
    }
}

/// Everything the target sends back is a sequence of well-formed ACK/NAK/READ_RESP frames.
fn check_responses(mut out: &[u8]) {
    while !out.is_empty() {
        assert!(out.len() >= HEADER_LEN, "truncated response header");
        let hb: &[u8; HEADER_LEN] = out[..HEADER_LEN].try_into().expect("44 bytes");
        let h = Header::decode(hb).expect("the target sent an undecodable frame");
        assert!(matches!(h.kind, Kind::Ack | Kind::Nak | Kind::ReadResp), "target sent {:?}", h.kind);
        if h.kind == Kind::Nak {
            assert_ne!(h.status, 0, "NAK with success status");
        }
        let n = HEADER_LEN + h.payload_len() as usize;
        assert!(out.len() >= n, "truncated READ_RESP payload");
        out = &out[n..];
    }
}

fuzz_target!(|data: &[u8]| {
    if let Some(hb) = data.get(..HEADER_LEN) {
        check_header(hb.try_into().expect("44 bytes"));
    }
    // The stream's hello (connection id and secret) is parsed by a total decoder too.
    let _ = runtime().block_on(read_hello(&mut &data[..]));
    // serve_frames reads the slice as the stream, writes responses into the Vec.
    let mut out = Vec::new();
    let _ = runtime().block_on(serve_frames(data, &mut out, grants(), &connection()));
    check_responses(&out);
});
