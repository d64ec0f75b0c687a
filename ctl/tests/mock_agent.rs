//! Runs the real `xferctl` binary against a small in-process mock of the `xfer.v1.Agent` service,
//! to check the client side of the contract: WriteRegion framing, ReadRegion reassembly,
//! cp/WatchTransfer and the exit codes for statuses and failed transfers. The mock is NOT the
//! agent: it copies within its own memory and fails transfers whose remote region is `fail-me`.

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

#[derive(Default)]
struct State {
    regions: HashMap<String, Vec<u8>>,
    transfers: HashMap<String, Transfer>,
    /// Data sizes of every WriteRegion message received, and the first message's target.
    write_messages: Vec<usize>,
    first_write: Option<(String, u64)>,
}

#[derive(Clone, Default)]
struct Mock(Arc<Mutex<State>>);

fn not_found(name: &str) -> Status {
    Status::not_found(format!("region {name:?} not found"))
}

fn region_msg(name: &str, data: &[u8]) -> Region {
    Region {
        id: format!("id-{name}"),
        name: name.into(),
        length: data.len() as u64,
        ..Default::default()
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Agent for Mock {
    async fn get_info(&self, _: Request<GetInfoRequest>) -> Result<Response<AgentInfo>, Status> {
        Ok(Response::new(AgentInfo {
            node_name: "mock".into(),
            version: "0.0.0".into(),
            fabric: FabricKind::Tcp as i32,
            fabric_reason: "mock".into(),
            ..Default::default()
        }))
    }
    async fn create_region(
        &self,
        r: Request<CreateRegionRequest>,
    ) -> Result<Response<Region>, Status> {
        let r = r.into_inner();
        let mut st = self.0.lock().unwrap();
        if st.regions.contains_key(&r.name) {
            return Err(Status::already_exists(format!(
                "region {:?} already exists",
                r.name
            )));
        }
        let data = vec![0u8; r.length as usize];
        let msg = region_msg(&r.name, &data);
        st.regions.insert(r.name, data);
        Ok(Response::new(msg))
    }
    async fn delete_region(
        &self,
        r: Request<DeleteRegionRequest>,
    ) -> Result<Response<DeleteRegionResponse>, Status> {
        let name = r.into_inner().name;
        match self.0.lock().unwrap().regions.remove(&name) {
            Some(_) => Ok(Response::new(DeleteRegionResponse {})),
            None => Err(not_found(&name)),
        }
    }
    async fn list_regions(
        &self,
        _: Request<ListRegionsRequest>,
    ) -> Result<Response<ListRegionsResponse>, Status> {
        let st = self.0.lock().unwrap();
        let regions = st.regions.iter().map(|(n, d)| region_msg(n, d)).collect();
        Ok(Response::new(ListRegionsResponse { regions }))
    }
    async fn get_region(&self, r: Request<GetRegionRequest>) -> Result<Response<Region>, Status> {
        let name = r.into_inner().name;
        let st = self.0.lock().unwrap();
        st.regions
            .get(&name)
            .map(|d| Response::new(region_msg(&name, d)))
            .ok_or_else(|| not_found(&name))
    }
    async fn write_region(
        &self,
        r: Request<Streaming<WriteRegionRequest>>,
    ) -> Result<Response<WriteRegionResponse>, Status> {
        let mut stream = r.into_inner();
        let mut target: Option<(String, u64)> = None;
        let mut written = 0u64;
        while let Some(msg) = stream.message().await? {
            let mut st = self.0.lock().unwrap();
            if target.is_none() {
                target = Some((msg.region.clone(), msg.offset));
                st.first_write = target.clone();
            }
            st.write_messages.push(msg.data.len());
            let (name, offset) = target.clone().unwrap();
            let region = st.regions.get_mut(&name).ok_or_else(|| not_found(&name))?;
            let start = (offset + written) as usize;
            let end = start + msg.data.len();
            if end > region.len() {
                return Err(Status::invalid_argument(format!(
                    "write beyond the end of region {name:?}"
                )));
            }
            region[start..end].copy_from_slice(&msg.data);
            written += msg.data.len() as u64;
        }
        Ok(Response::new(WriteRegionResponse {
            bytes_written: written,
        }))
    }
    type ReadRegionStream = BoxStream<ReadRegionResponse>;
    async fn read_region(
        &self,
        r: Request<ReadRegionRequest>,
    ) -> Result<Response<Self::ReadRegionStream>, Status> {
        let r = r.into_inner();
        let st = self.0.lock().unwrap();
        let data = st
            .regions
            .get(&r.region)
            .ok_or_else(|| not_found(&r.region))?;
        let (start, end) = (r.offset as usize, (r.offset + r.length) as usize);
        if end > data.len() {
            return Err(Status::out_of_range("read beyond the end of the region"));
        }
        // Odd chunk size on purpose: the client must reassemble by offset.
        let msgs: Vec<Result<ReadRegionResponse, Status>> = (start..end)
            .step_by(300_000)
            .map(|o| {
                Ok(ReadRegionResponse {
                    offset: o as u64,
                    data: data[o..end.min(o + 300_000)].to_vec(),
                })
            })
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(msgs))))
    }
    async fn checksum(
        &self,
        _: Request<ChecksumRequest>,
    ) -> Result<Response<ChecksumResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }
    async fn submit_transfer(
        &self,
        r: Request<SubmitTransferRequest>,
    ) -> Result<Response<Transfer>, Status> {
        let r = r.into_inner();
        let (local, remote) = (
            r.local.clone().unwrap_or_default(),
            r.remote.clone().unwrap_or_default(),
        );
        let mut st = self.0.lock().unwrap();
        let id = format!("t{}", st.transfers.len() + 1);
        let mut t = Transfer {
            id: id.clone(),
            op: r.op,
            local: r.local,
            remote: r.remote,
            length: r.length,
            state: TransferState::Queued as i32,
            ..Default::default()
        };
        if remote.region == "fail-me" {
            t.state = TransferState::Failed as i32;
            t.error = "remote access error on chunk 0".into();
            t.error_code = "REM_ACCESS_ERR".into();
        } else {
            let l = (local.region.clone(), local.offset);
            let rm = (remote.region.clone(), remote.offset);
            let (src, dst) = if r.op == Op::Write as i32 {
                (l, rm)
            } else {
                (rm, l)
            };
            let src_data = st
                .regions
                .get(&src.0)
                .ok_or_else(|| not_found(&src.0))?
                .clone();
            let len = if r.length == 0 {
                src_data.len() as u64 - src.1
            } else {
                r.length
            };
            let dst_data = st
                .regions
                .get_mut(&dst.0)
                .ok_or_else(|| not_found(&dst.0))?;
            let (s, d, n) = (src.1 as usize, dst.1 as usize, len as usize);
            dst_data[d..d + n].copy_from_slice(&src_data[s..s + n]);
            t.length = len;
            t.bytes_done = len;
            t.elapsed_seconds = 0.25;
            t.state = TransferState::Succeeded as i32;
            t.verified = r.options.map(|o| o.verify).unwrap_or(false);
        }
        st.transfers.insert(id.clone(), t.clone());
        // The submit answer is the QUEUED record; the watch shows the outcome.
        let mut queued = t;
        queued.state = TransferState::Queued as i32;
        Ok(Response::new(queued))
    }
    type WatchTransferStream = BoxStream<Transfer>;
    async fn watch_transfer(
        &self,
        r: Request<WatchTransferRequest>,
    ) -> Result<Response<Self::WatchTransferStream>, Status> {
        let id = r.into_inner().id;
        let t = self.0.lock().unwrap().transfers.get(&id).cloned();
        let t = t.ok_or_else(|| Status::not_found(format!("transfer {id} not found")))?;
        let mut running = t.clone();
        running.state = TransferState::Running as i32;
        running.bytes_done = t.length / 2;
        Ok(Response::new(Box::pin(futures::stream::iter(vec![
            Ok(running),
            Ok(t),
        ]))))
    }
    async fn get_transfer(
        &self,
        r: Request<GetTransferRequest>,
    ) -> Result<Response<Transfer>, Status> {
        let id = r.into_inner().id;
        let t = self.0.lock().unwrap().transfers.get(&id).cloned();
        t.map(Response::new)
            .ok_or_else(|| Status::not_found(format!("transfer {id} not found")))
    }
    async fn list_transfers(
        &self,
        _: Request<ListTransfersRequest>,
    ) -> Result<Response<ListTransfersResponse>, Status> {
        let transfers = self.0.lock().unwrap().transfers.values().cloned().collect();
        Ok(Response::new(ListTransfersResponse { transfers }))
    }
    async fn cancel_transfer(
        &self,
        _: Request<CancelTransferRequest>,
    ) -> Result<Response<Transfer>, Status> {
        Err(Status::failed_precondition("transfer already finished"))
    }
    async fn connect(&self, _: Request<ConnectRequest>) -> Result<Response<PeerInfo>, Status> {
        Err(Status::unavailable("peer 10.0.0.9:7470 unreachable"))
    }
    async fn list_peers(
        &self,
        _: Request<ListPeersRequest>,
    ) -> Result<Response<ListPeersResponse>, Status> {
        Ok(Response::new(ListPeersResponse::default()))
    }
    async fn bench(&self, r: Request<BenchRequest>) -> Result<Response<BenchResponse>, Status> {
        let r = r.into_inner();
        Ok(Response::new(BenchResponse {
            size: r.size,
            iters: 10,
            bytes: r.size * 10,
            seconds: 0.001,
            lat_avg_us: 5.0,
            lat_p50_us: 4.0,
            lat_p99_us: 9.0,
            ..Default::default()
        }))
    }
    async fn tcp_baseline(
        &self,
        r: Request<TcpBaselineRequest>,
    ) -> Result<Response<TcpBaselineResponse>, Status> {
        let r = r.into_inner();
        Ok(Response::new(TcpBaselineResponse {
            bytes: r.bytes,
            seconds: 1.0,
            gbit_per_s: 10.0,
        }))
    }
}

async fn start() -> (Mock, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mock = Mock::default();
    let service = AgentServer::new(mock.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (mock, addr)
}

/// Runs xferctl on a blocking thread so the mock keeps serving.
async fn xferctl(addr: SocketAddr, args: &[&str]) -> Output {
    let mut full = vec!["--agent".to_string(), addr.to_string()];
    full.extend(args.iter().map(|s| s.to_string()));
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_xferctl"))
            .args(&full)
            .env_remove("XFER_AGENT")
            .output()
            .expect("run xferctl")
    })
    .await
    .unwrap()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_put_get_cp_and_errors() {
    let (mock, addr) = start().await;
    let dir = tempfile::tempdir().unwrap();

    let o = xferctl(addr, &["region", "create", "src", "--size", "4MiB"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let o = xferctl(addr, &["region", "create", "dst", "--size", "4MiB"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));

    // Duplicate name: ALREADY_EXISTS -> 13.
    let o = xferctl(addr, &["region", "create", "src", "--size", "1KiB"]).await;
    assert_eq!(o.status.code(), Some(13), "{}", err(&o));

    // Missing region: NOT_FOUND -> 3, one line naming the code.
    let o = xferctl(addr, &["region", "show", "foo"]).await;
    assert_eq!(o.status.code(), Some(3), "{}", err(&o));
    assert_eq!(err(&o).lines().count(), 1, "{}", err(&o));
    assert!(err(&o).starts_with("error: "), "{}", err(&o));
    assert!(
        err(&o)
            .trim_end()
            .ends_with(r#"region "foo" not found (NOT_FOUND)"#),
        "{}",
        err(&o)
    );

    // JSON list.
    let o = xferctl(addr, &["--json", "region", "list"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["dst", "src"]);

    // put: 1 MiB messages, region and offset in the first one.
    let payload: Vec<u8> = (0..(2 << 20) + 12345u32).map(|i| (i % 251) as u8).collect();
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &payload).unwrap();
    let o = xferctl(addr, &["put", input.to_str().unwrap(), "src@4KiB"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(
        out(&o).contains(&format!("{} bytes in", payload.len())),
        "{}",
        out(&o)
    );
    {
        let st = mock.0.lock().unwrap();
        assert_eq!(st.first_write, Some(("src".to_string(), 4096)));
        assert_eq!(st.write_messages, [1 << 20, 1 << 20, 12345]);
        assert_eq!(&st.regions["src"][4096..4096 + payload.len()], &payload[..]);
    }

    // get: reassembles the mock's 300 kB chunks into the file.
    let output = dir.path().join("out.bin");
    let len = payload.len().to_string();
    let o = xferctl(
        addr,
        &["get", "src@4096", "--len", &len, output.to_str().unwrap()],
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert_eq!(std::fs::read(&output).unwrap(), payload);

    // get to stdout: data on stdout, summary on stderr.
    let o = xferctl(addr, &["get", "src@4KiB", "--len", "1000", "-"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert_eq!(o.stdout, payload[..1000]);
    assert!(err(&o).contains("1000 bytes in"), "{}", err(&o));

    // Reading past the end: OUT_OF_RANGE -> 4.
    let o = xferctl(addr, &["get", "src@4MiB", "--len", "1", "-"]).await;
    assert_eq!(o.status.code(), Some(4), "{}", err(&o));

    // cp with an explicit agent on DST (the same mock), WRITE from the SRC agent.
    let dst = format!("{addr}:dst@1MiB");
    let o = xferctl(addr, &["cp", "src@4KiB", &dst, "--len", "2MiB"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert_eq!(
        out(&o).trim(),
        "copied 2097152 bytes in 0.250 s (0.008 GiB/s)"
    );
    {
        let st = mock.0.lock().unwrap();
        assert_eq!(&st.regions["dst"][1 << 20..3 << 20], &payload[..2 << 20]);
        let t = &st.transfers["t1"];
        assert_eq!(t.op, Op::Write as i32);
        assert_eq!(t.remote.as_ref().unwrap().agent, addr.to_string());
    }

    // --pull: READ initiated by the DST agent; --json prints the final record.
    let o = xferctl(addr, &["--json", "cp", "--pull", "--verify", "src", "dst"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["op"], "read");
    assert_eq!(v["state"], "succeeded");
    assert_eq!(v["local"]["region"], "dst");
    assert_eq!(v["remote"]["region"], "src");

    // A FAILED transfer -> 10 with the error and error_code.
    let o = xferctl(addr, &["cp", "src", "fail-me"]).await;
    assert_eq!(o.status.code(), Some(10), "{}", err(&o));
    assert_eq!(err(&o).lines().count(), 1, "{}", err(&o));
    assert!(
        err(&o).contains("remote access error on chunk 0 (REM_ACCESS_ERR)"),
        "{}",
        err(&o)
    );

    // transfer watch of a failed transfer exits the same way; show/list work.
    let o = xferctl(addr, &["transfer", "watch", "t3"]).await;
    assert_eq!(o.status.code(), Some(10), "{}", err(&o));
    let o = xferctl(addr, &["transfer", "show", "t1"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(out(&o).contains("succeeded"), "{}", out(&o));
    let o = xferctl(addr, &["transfer", "watch", "t99"]).await;
    assert_eq!(o.status.code(), Some(3), "{}", err(&o));
    let o = xferctl(addr, &["transfer", "cancel", "t1"]).await;
    assert_eq!(o.status.code(), Some(6), "{}", err(&o));

    // A peer the agent cannot reach: UNAVAILABLE -> 8.
    let o = xferctl(addr, &["connect", "10.0.0.9"]).await;
    assert_eq!(o.status.code(), Some(8), "{}", err(&o));
    assert!(err(&o).contains("(UNAVAILABLE)"), "{}", err(&o));

    // bench with a baseline, as JSON.
    let o = xferctl(
        addr,
        &[
            "--json",
            "bench",
            "--peer",
            "h",
            "--sizes",
            "4KiB,1MiB",
            "--baseline",
            "tcp",
        ],
    )
    .await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["rows"].as_array().unwrap().len(), 2);
    assert_eq!(v["baseline"]["bytes"], 1u64 << 30);

    let o = xferctl(addr, &["region", "delete", "dst"]).await;
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let o = xferctl(addr, &["region", "delete", "dst"]).await;
    assert_eq!(o.status.code(), Some(3), "{}", err(&o));
}
