//! A fabric serving standby rails ([`Serving::StandbyRails`]) over real loopback
//! sockets: its streams outlive `limits.data_idle_timeout`, while a plain fabric's stream opened
//! after them with the same limits is closed for idleness.
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use xfer_engine::ids::ConnectionId;
use xfer_rdma::memory::RegionMemory;

use super::hello::encode_hello;
use super::{registration, DataLimits, Serving, TcpFabric};
use crate::grant::{AccessCheck, Checked, GrantGate};
use crate::{Access, Completion, Connection, Endpoint, Fabric, RemoteKey, RemoteOp, WcStatus, WorkRequest, WrOp};

const TOKEN: [u8; 16] = [0x5a; 16];
const LEN: usize = 4096;

/// One WRITE grant over a whole page at address 0.
struct WriteAll {
    memory: Arc<RegionMemory>,
    gate: Arc<GrantGate>,
}

impl AccessCheck for WriteAll {
    fn check(&self, _: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
        if token != &TOKEN || op != RemoteOp::Write || addr.checked_add(len).is_none_or(|end| end > LEN as u64) {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(Checked { memory: self.memory.clone(), offset: addr, gate: self.gate.clone(), window: None })
    }

    fn marker(&self, _: &ConnectionId, _: &[u8; 16], _: u32) -> Result<(), WcStatus> {
        Err(WcStatus::RemAccessErr)
    }
}

fn write_all() -> Arc<WriteAll> {
    let memory = Arc::new(RegionMemory::anonymous(LEN, false).expect("a page"));
    Arc::new(WriteAll { memory, gate: GrantGate::new(std::time::SystemTime::now() + Duration::from_secs(3600)) })
}

/// A responder on loopback whose streams are closed after 100 ms without a frame.
async fn responder(check: Arc<WriteAll>, standby: bool) -> TcpFabric {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let limits = DataLimits { idle_timeout: Duration::from_millis(100), ..DataLimits::default() };
    let serving = if standby { Serving::StandbyRails } else { Serving::Connections };
    TcpFabric::serve(listener, check, None, limits, serving).expect("serve")
}

/// One connection of one stream from `initiator` to `standby` as `id` (the responder's half is
/// returned too: dropping it ends the session), and its completions.
async fn connect(
    initiator: &TcpFabric,
    standby: &TcpFabric,
    id: &str,
) -> (Arc<dyn Connection>, Box<dyn crate::Accepted>, mpsc::UnboundedReceiver<Completion>) {
    let id = ConnectionId::parse(id).expect("valid id");
    let (answer, accepted) = standby.accept("peer", &id, &[]).await.expect("accept");
    let (sink, completions) = mpsc::unbounded_channel();
    let pending = initiator.prepare("peer", &id, 1, 4, sink).await.expect("prepare");
    let conn = pending.complete(&answer).await.expect("streams open");
    (conn, accepted, completions)
}

#[tokio::test]
async fn a_standby_rail_outlives_the_idle_timeout_that_closes_a_plain_stream() {
    let standby_check = write_all();
    let standby = responder(standby_check.clone(), true).await;
    let plain = responder(write_all(), false).await;
    let initiator = TcpFabric::bind("127.0.0.1:0".parse().expect("addr"), write_all(), None).await.expect("bind");
    // The standby's stream first: its idle deadline, had it one, would pass before the plain one's.
    let (rail, _rail_session, mut done) = connect(&initiator, &standby, "standby-rail").await;

    // A plain stream with a valid hello, then silence: the plain fabric closes it for idleness
    // (the read sees the end; 30 s is a hang guard, not a bound).
    let id = ConnectionId::parse("plain-conn").expect("valid id");
    let (answer, _plain_session) = plain.accept("peer", &id, &[]).await.expect("accept");
    let Some(Endpoint::Tcp { address, secret: Some(secret) }) = answer.first() else { panic!("not a tcp answer: {answer:?}") };
    let mut s = tokio::net::TcpStream::connect(address).await.expect("connect");
    s.write_all(&encode_hello(&id, secret)).await.expect("hello");
    let mut b = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut b)).await.expect("closed within 30 s").expect("read");
    assert_eq!(n, 0, "the plain fabric answered an idle stream");

    // The standby, idle for longer, is open and still carries a WRITE.
    assert!(!rail.is_broken(), "the standby rail was closed");
    let memory = Arc::new(RegionMemory::anonymous(LEN, false).expect("a page"));
    memory.write_at(0, &[0xc3; 64]).expect("fill");
    let local = registration(memory, Access::ReadWrite);
    let wr = WorkRequest {
        wr_id: 7,
        op: WrOp::Write,
        local,
        local_offset: 0,
        len: 64,
        remote_addr: 0,
        remote_key: RemoteKey::Token(TOKEN),
        signaled: true,
    };
    rail.post(0, wr).expect("post on the standby rail");
    let c = done.recv().await.expect("a completion");
    assert_eq!((c.wr_id, c.status), (7, WcStatus::Success), "{c:?}");
    let mut landed = [0u8; 64];
    standby_check.memory.read_at(0, &mut landed).expect("read back");
    assert_eq!(landed, [0xc3; 64]);
}
