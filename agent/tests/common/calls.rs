//! Calls through any client (an mTLS identity from `pki`, the unix socket, or plaintext): the
//! tests that compare what one identity may do with what another may do drive the same calls
//! through different clients.
use std::path::Path;

use tonic::transport::Channel;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;

use super::Agent;

/// Writes `data` at `offset` of `region` through `c`.
pub async fn put_via(c: &mut AgentClient<Channel>, region: &str, offset: u64, data: &[u8]) {
    let msg = pb::WriteRegionRequest { region: region.into(), offset, data: data.to_vec() };
    c.write_region(futures::stream::iter(vec![msg])).await.unwrap();
}

/// Reads `length` bytes (0: to the end) at `offset` of `region` through `c`.
pub async fn read_via(c: &mut AgentClient<Channel>, region: &str, offset: u64, length: u64) -> Vec<u8> {
    let mut s = c.read_region(pb::ReadRegionRequest { region: region.into(), offset, length }).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(m) = s.message().await.unwrap() {
        got.extend_from_slice(&m.data);
    }
    got
}

/// Submits `req` through `c` and watches it to its end.
pub async fn run_via(c: &mut AgentClient<Channel>, req: pb::SubmitTransferRequest) -> Result<pb::Transfer, tonic::Status> {
    let t = c.submit_transfer(req).await?.into_inner();
    let mut w = c.watch_transfer(pb::WatchTransferRequest { id: t.id.clone() }).await?.into_inner();
    let mut last = t;
    while let Some(m) = w.message().await? {
        last = m;
    }
    Ok(last)
}

/// A gRPC channel over the agent's unix socket at `path`.
pub async fn unix_channel(path: &Path) -> Channel {
    let path = path.to_path_buf();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
        .unwrap()
}

/// The gRPC port `a` listens on.
pub fn port_of(a: &Agent) -> u16 {
    a.addr().rsplit_once(':').unwrap().1.parse().unwrap()
}
