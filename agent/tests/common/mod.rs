//! Test harness: real `xfer-agent` processes on 127.0.0.1 with temp state dirs, driven by the
//! real `xferctl` binary and by real gRPC clients. Agents listen on port 0 and report the ports
//! they bound in their ready file (`--ready-file`): no port is chosen before it is bound, so
//! parallel test binaries cannot race for one.
//!
//! By role: `process` starts, talks to and stops agents; `requests` builds the messages tests
//! send and follows transfers; `scrape` reads metrics; `host` is the test process's own
//! resources; `calls`, `wire`, `chan` and `pki` are raw calls, raw data streams, channels and
//! certificates; `ktls` runs mTLS agents with kernel TLS and reads its counter.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

pub mod calls;
pub mod chan;
mod host;
mod ktls;
pub mod pki;
mod process;
mod requests;
mod scrape;
pub mod wire;

// Re-exported for `use crate::common::*`; a binary that uses only some of the harness leaves
// the rest unused (`dead_code` above).
#[allow(unused_imports)]
pub use calls::{port_of, put_via, read_via, run_via, unix_channel};
#[allow(unused_imports)]
pub use host::*;
#[allow(unused_imports)]
pub use ktls::*;
#[allow(unused_imports)]
pub use process::*;
#[allow(unused_imports)]
pub use requests::*;
#[allow(unused_imports)]
pub use scrape::*;
#[allow(unused_imports)]
pub use wire::{
    assert_closed, frame, frame_header, open_data_stream, raw_read, raw_write, read_frame_answer, read_header, token_of, DataSession,
    Header, Kind,
};

/// How long a test's blocking socket read may wait before it fails the test instead of hanging
/// it. Never what a test waits *for*: every guarded read has its answer (bytes, EOF or a reset)
/// already on the way, so the bound is only reached when the agent is broken, and it is long so
/// that no loaded machine reaches it. Silence is never asserted by a read timing out: a stream
/// that must be closed is read to its end ([`wire::assert_closed`]), one that must stay open
/// answers a frame.
pub const READ_GUARD: std::time::Duration = std::time::Duration::from_secs(120);
