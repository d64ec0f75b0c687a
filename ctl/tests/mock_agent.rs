//! The real `xferctl` binary against a minimal in-process fake of the `xfer.v1.Agent` service,
//! kept only for what a real agent cannot show: the client's stream framing.
//!
//! * WriteRegion framing (`put`): the client must send 1 MiB messages with the region and offset
//!   in the first message only. A real agent accepts other framings too and cannot report the
//!   messages it received, so only a fake can observe them.
//! * ReadRegion reassembly (`get`): the fake answers in odd 300 000-byte messages, each with its
//!   offset, which the real agent never does (it uses its own fixed chunk size); the client must
//!   reassemble by offset.
//!
//! * Hostile text (`region show`): a region whose labels and path carry terminal escape
//!   sequences, and an error message carrying them, which a real agent refuses to store or
//!   send; the client must still print them inert, whatever agent it talks to.
//!
//! Everything else (statuses, exit codes, cp/watch, failed transfers, bench) is tested against real
//! agents in `ctl/tests/real_agent.rs`. The fake holds regions in memory, implements
//! CreateRegion, GetRegion, WriteRegion and ReadRegion, and answers UNIMPLEMENTED to the rest: it
//! copies none of the agent's behaviour or error strings beyond what these two checks need.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use futures::Stream;
use tonic::{Request, Response, Status, Streaming};
use xfer_proto::v1::agent_server::{Agent, AgentServer};
use xfer_proto::v1::*;

/// Sets the window title, clears the screen (C1 CSI), sounds the bell and reverses the text.
const HOSTILE: &str = "\u{1b}]0;pwned\u{7}\u{9b}2J\r\u{202e}x";

/// The odd ReadRegion message size.
const READ_CHUNK: usize = 300_000;

#[derive(Default)]
struct State {
    regions: HashMap<String, Vec<u8>>,
    /// Data sizes of every WriteRegion message received, and the (region, offset) of each.
    write_messages: Vec<usize>,
    write_targets: Vec<(String, u64)>,
}

#[derive(Clone, Default)]
struct Fake(Arc<Mutex<State>>);

fn region_msg(name: &str, len: usize) -> Region {
    Region { id: format!("id-{name}"), name: name.into(), length: len as u64, ..Default::default() }
}

fn not_here() -> Status {
    Status::unimplemented("not part of the framing fake")
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Agent for Fake {
    async fn create_region(&self, r: Request<CreateRegionRequest>) -> Result<Response<Region>, Status> {
        let r = r.into_inner();
        self.0.lock().unwrap().regions.insert(r.name.clone(), vec![0u8; r.length as usize]);
        Ok(Response::new(region_msg(&r.name, r.length as usize)))
    }
    async fn get_region(&self, r: Request<GetRegionRequest>) -> Result<Response<Region>, Status> {
        let name = r.into_inner().name;
        if name == "hostile" {
            let labels = HashMap::from([("k".to_string(), HOSTILE.to_string())]);
            return Ok(Response::new(Region { labels, path: HOSTILE.into(), ..region_msg("hostile\u{9b}2J", 1) }));
        }
        if name == "hostile-error" {
            return Err(Status::not_found(format!("no such region {HOSTILE}")));
        }
        let st = self.0.lock().unwrap();
        st.regions.get(&name).map(|d| Response::new(region_msg(&name, d.len()))).ok_or_else(|| Status::not_found(name))
    }
    async fn write_region(&self, r: Request<Streaming<WriteRegionRequest>>) -> Result<Response<WriteRegionResponse>, Status> {
        let mut stream = r.into_inner();
        let mut target: Option<(String, u64)> = None;
        let mut written = 0u64;
        while let Some(msg) = stream.message().await? {
            let mut st = self.0.lock().unwrap();
            st.write_messages.push(msg.data.len());
            st.write_targets.push((msg.region.clone(), msg.offset));
            let (name, offset) = target.get_or_insert((msg.region.clone(), msg.offset)).clone();
            let region = st.regions.get_mut(&name).ok_or_else(|| Status::not_found(name.clone()))?;
            let start = (offset + written) as usize;
            let end = start + msg.data.len();
            if end > region.len() {
                return Err(Status::invalid_argument("past the end"));
            }
            region[start..end].copy_from_slice(&msg.data);
            written += msg.data.len() as u64;
        }
        Ok(Response::new(WriteRegionResponse { bytes_written: written }))
    }
    type ReadRegionStream = BoxStream<ReadRegionResponse>;
    async fn read_region(&self, r: Request<ReadRegionRequest>) -> Result<Response<Self::ReadRegionStream>, Status> {
        let r = r.into_inner();
        let st = self.0.lock().unwrap();
        let data = st.regions.get(&r.region).ok_or_else(|| Status::not_found(r.region.clone()))?;
        let (start, end) = (r.offset as usize, (r.offset + r.length) as usize);
        if end > data.len() {
            return Err(Status::out_of_range("past the end"));
        }
        let msgs: Vec<Result<ReadRegionResponse, Status>> = (start..end)
            .step_by(READ_CHUNK)
            .map(|o| Ok(ReadRegionResponse { offset: o as u64, data: data[o..end.min(o + READ_CHUNK)].to_vec() }))
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(msgs))))
    }

    async fn get_info(&self, _: Request<GetInfoRequest>) -> Result<Response<AgentInfo>, Status> {
        Err(not_here())
    }
    async fn delete_region(&self, _: Request<DeleteRegionRequest>) -> Result<Response<DeleteRegionResponse>, Status> {
        Err(not_here())
    }
    async fn list_regions(&self, _: Request<ListRegionsRequest>) -> Result<Response<ListRegionsResponse>, Status> {
        Err(not_here())
    }
    async fn checksum(&self, _: Request<ChecksumRequest>) -> Result<Response<ChecksumResponse>, Status> {
        Err(not_here())
    }
    async fn submit_transfer(&self, _: Request<SubmitTransferRequest>) -> Result<Response<Transfer>, Status> {
        Err(not_here())
    }
    type WatchTransferStream = BoxStream<Transfer>;
    async fn watch_transfer(&self, _: Request<WatchTransferRequest>) -> Result<Response<Self::WatchTransferStream>, Status> {
        Err(not_here())
    }
    type OpenChannelStream = BoxStream<xfer_proto::v1::ChannelEvent>;
    async fn open_channel(
        &self,
        _: Request<tonic::Streaming<xfer_proto::v1::ChannelRequest>>,
    ) -> Result<Response<Self::OpenChannelStream>, Status> {
        Err(not_here())
    }
    type WatchInboundStream = BoxStream<xfer_proto::v1::Notification>;
    async fn watch_inbound(&self, _: Request<xfer_proto::v1::WatchInboundRequest>) -> Result<Response<Self::WatchInboundStream>, Status> {
        Err(not_here())
    }
    type WatchInboundRingStream = BoxStream<xfer_proto::v1::InboundRing>;
    async fn watch_inbound_ring(
        &self,
        _: Request<xfer_proto::v1::WatchInboundRingRequest>,
    ) -> Result<Response<Self::WatchInboundRingStream>, Status> {
        Err(not_here())
    }
    async fn get_transfer(&self, _: Request<GetTransferRequest>) -> Result<Response<Transfer>, Status> {
        Err(not_here())
    }
    async fn list_transfers(&self, _: Request<ListTransfersRequest>) -> Result<Response<ListTransfersResponse>, Status> {
        Err(not_here())
    }
    async fn cancel_transfer(&self, _: Request<CancelTransferRequest>) -> Result<Response<Transfer>, Status> {
        Err(not_here())
    }
    async fn connect(&self, _: Request<ConnectRequest>) -> Result<Response<PeerInfo>, Status> {
        Err(not_here())
    }
    async fn list_peers(&self, _: Request<ListPeersRequest>) -> Result<Response<ListPeersResponse>, Status> {
        Err(not_here())
    }
    async fn bench(&self, _: Request<BenchRequest>) -> Result<Response<BenchResponse>, Status> {
        Err(not_here())
    }
    async fn tcp_baseline(&self, _: Request<TcpBaselineRequest>) -> Result<Response<TcpBaselineResponse>, Status> {
        Err(not_here())
    }
}

async fn start() -> (Fake, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = Fake::default();
    let service = AgentServer::new(fake.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (fake, addr)
}

/// Runs xferctl on a blocking thread so the fake keeps serving.
async fn xferctl(addr: SocketAddr, args: &[&str]) -> Output {
    let mut full = vec!["--agent".to_string(), addr.to_string()];
    full.extend(args.iter().map(|s| s.to_string()));
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_xferctl")).args(&full).env_remove("XFER_AGENT").output().expect("run xferctl")
    })
    .await
    .unwrap()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_frames_1_mib_messages_and_get_reassembles_odd_ones() {
    let (fake, addr) = start().await;
    let dir = tempfile::tempdir().unwrap();
    let o = xferctl(addr, &["region", "create", "src", "--size", "4MiB"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));

    // put: 1 MiB messages, region and offset in the first one only.
    let payload: Vec<u8> = (0..(2 << 20) + 12345u32).map(|i| (i % 251) as u8).collect();
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &payload).unwrap();
    let o = xferctl(addr, &["put", input.to_str().unwrap(), "src@4KiB"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    {
        let st = fake.0.lock().unwrap();
        assert_eq!(st.write_messages, [1 << 20, 1 << 20, 12345]);
        assert_eq!(
            st.write_targets,
            [("src".to_string(), 4096), (String::new(), 0), (String::new(), 0)],
            "region and offset only in the first message"
        );
        assert!(st.regions["src"][4096..4096 + payload.len()] == payload[..]);
    }

    // get: the fake's 300 000-byte messages reassembled into the file, and onto stdout.
    let output = dir.path().join("out.bin");
    let len = payload.len().to_string();
    let o = xferctl(addr, &["get", "src@4096", "--len", &len, output.to_str().unwrap()]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(std::fs::read(&output).unwrap() == payload);
    let o = xferctl(addr, &["get", "src@4KiB", "--len", &len, "-"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(o.stdout == payload);
}

/// Nothing an agent sends can reach the terminal as a control sequence: `region show` (text and
/// JSON) and the error line print it escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_from_the_agent_is_printed_inert() {
    let (_fake, addr) = start().await;
    let inert = |b: &[u8]| {
        let t = String::from_utf8_lossy(b).into_owned();
        assert!(!t.chars().any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'), "{t:?}");
        t
    };
    let o = xferctl(addr, &["region", "show", "hostile"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let text = inert(&o.stdout);
    assert!(text.contains("k=\\u001b]0;pwned\\u0007\\u009b2J\\u000d\\u202ex"), "{text}");
    let o = xferctl(addr, &["--json", "region", "show", "hostile"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&inert(&o.stdout)).unwrap();
    assert_eq!(v["labels"]["k"], HOSTILE, "the JSON still carries the exact value");
    let o = xferctl(addr, &["region", "show", "hostile-error"]).await;
    assert_eq!(o.status.code(), Some(3), "{}", err(&o));
    assert!(inert(&o.stderr).contains("no such region \\u001b]0;pwned"), "{}", err(&o));
}
