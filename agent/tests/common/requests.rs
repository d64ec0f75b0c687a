//! Request builders and transfer helpers: the gRPC messages tests send (regions, connects,
//! grants, completes, transfers), test data, and following a transfer or a subscription.
use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

use xfer_proto::v1 as pb;

use super::process::Agent;

/// An anonymous read-write region request.
pub fn anon(name: &str, len: u64) -> pb::CreateRegionRequest {
    pb::CreateRegionRequest {
        name: name.into(),
        length: len,
        kind: pb::RegionKind::Anonymous as i32,
        access: pb::Access::ReadWrite as i32,
        ..Default::default()
    }
}

/// `Peer.Connect` (tcp) as connection `id`; the declared name is ignored by the agent.
pub fn connect_req(id: &str) -> pb::PeerConnectRequest {
    pb::PeerConnectRequest {
        version: 1,
        node_name: "whoever".into(),
        fabric: pb::FabricKind::Tcp as i32,
        endpoints: vec![],
        connection_id: id.into(),
    }
}

/// A 4 KiB grant at offset 0 of `region` for `op`, on the caller's connection `conn` (tcp grants
/// are bound to one), declaring the node name `declared` (which the agent ignores).
pub fn grant_req(region: &str, declared: &str, conn: &str, op: pb::Access) -> pb::GrantRequest {
    pb::GrantRequest {
        notify: None,
        region: region.into(),
        offset: 0,
        length: 4096,
        op: op as i32,
        ttl: None,
        node_name: declared.into(),
        connection_id: conn.into(),
    }
}

/// `Peer.Complete` of a WRITE grant, recorded as `transfer_id`.
pub fn complete_req(grant_id: &str, transfer_id: &str, bytes: u64, declared: &str) -> pb::CompleteRequest {
    pb::CompleteRequest {
        transfer_id: transfer_id.into(),
        grant_id: grant_id.into(),
        bytes,
        op: pb::Op::Write as i32,
        node_name: declared.into(),
        ..Default::default()
    }
}

pub fn write_req(local: &str, peer: &Agent, remote: &str, len: u64) -> pb::SubmitTransferRequest {
    pb::SubmitTransferRequest {
        notify: None,
        segments: Vec::new(),
        op: pb::Op::Write as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: peer.addr(), region: remote.into(), offset: 0 }),
        length: (len != 0).then_some(len),
        options: None,
    }
}

pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn stderr_lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr).lines().filter(|l| !l.trim().is_empty()).map(String::from).collect()
}

/// 4 KiB chunks, one outstanding, one QP: a transfer slow enough to act on while it runs.
pub fn make_slow(req: &mut pb::SubmitTransferRequest) {
    req.options = Some(pb::TransferOptions { chunk_size: 4096, depth: 1, qps: 1, ..Default::default() });
}

/// Waits until the transfer has moved some bytes.
pub async fn wait_progress(a: &Agent, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let t = a.client().await.get_transfer(pb::GetTransferRequest { id: id.into() }).await.unwrap().into_inner();
        if t.bytes_done > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "transfer never progressed: {t:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Follows a transfer to its terminal record.
pub async fn watch_to_end(a: &Agent, id: &str) -> pb::Transfer {
    let mut w = a.client().await.watch_transfer(pb::WatchTransferRequest { id: id.into() }).await.unwrap().into_inner();
    let mut last = None;
    while let Some(m) = w.message().await.unwrap() {
        last = Some(m);
    }
    last.unwrap()
}

/// The agent's default file root (`<state_dir>/files`).
pub fn root_of(a: &Agent) -> PathBuf {
    a.state_dir.join("files")
}

/// CreateRegion for a file region over `path` (relative to a file root).
pub fn file_region_req(name: &str, len: u64, path: &str, access: pb::Access) -> pb::CreateRegionRequest {
    pb::CreateRegionRequest {
        name: name.into(),
        length: len,
        kind: pb::RegionKind::File as i32,
        path: path.into(),
        access: access as i32,
        ..Default::default()
    }
}

/// A tcp grant on `region` for `op` over its first `len` bytes on connection `conn`, asked
/// through the Peer service: (addr, token).
pub async fn grant_token(a: &Agent, region: &str, len: u64, op: pb::Access, conn: &str) -> Result<(u64, [u8; 16]), tonic::Status> {
    let g = a
        .peer_client()
        .await
        .grant(pb::GrantRequest {
            notify: None,
            region: region.into(),
            offset: 0,
            length: len,
            op: op as i32,
            ttl: None,
            node_name: "node-x".into(),
            connection_id: conn.into(),
        })
        .await?
        .into_inner();
    Ok((g.addr, g.token.as_slice().try_into().unwrap()))
}

/// Subscribes to `a`'s notifications (`WatchInbound`); subscribed once this returns.
pub async fn subscribe(a: &Agent, region: &str, tag: Option<&[u8]>) -> tonic::Streaming<pb::Notification> {
    a.client()
        .await
        .watch_inbound(pb::WatchInboundRequest { region: region.into(), tag: tag.map(<[u8]>::to_vec) })
        .await
        .unwrap()
        .into_inner()
}

/// The subscriber's next notification (30 s: a hang guard, not a synchronisation).
pub async fn next_note(s: &mut tonic::Streaming<pb::Notification>) -> pb::Notification {
    tokio::time::timeout(Duration::from_secs(30), s.message()).await.expect("a notification within 30 s").unwrap().expect("stream open")
}
