//! The initiator's side of a tcp connection: its data streams opened (TLS when on) and bound to
//! the connection with the hello, then one `TcpQp` per stream.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::hello::encode_hello;
use super::limits::HELLO_TIMEOUT;
use super::qp::{BoxRead, BoxWrite, TcpQp};
use crate::identity::tls::DataTls;
use crate::identity::Role;
use crate::{CompletionSink, Connection, DataSecret, Endpoint, FabricError, PendingConnection, RemoteKey, WorkRequest, WrOp};
use xfer_engine::ids::ConnectionId;

pub(super) struct TcpPrepared {
    pub(super) qps: usize,
    pub(super) sink: CompletionSink,
    /// The peer's gRPC address: the data host when the target listens on an unspecified address,
    /// and the TLS server name.
    pub(super) peer: String,
    pub(super) connection: ConnectionId,
    pub(super) tls: Option<DataTls>,
}

impl TcpPrepared {
    /// Opens one data stream (TLS when on) and sends the hello.
    async fn open_stream(&self, address: SocketAddr, secret: &DataSecret) -> Result<(BoxRead, BoxWrite), FabricError> {
        let connect_err = |e: std::io::Error| FabricError::Connect { addr: address.to_string(), source: e };
        let stream = if address.ip().is_unspecified() {
            // The target listens on every address: reach it where its gRPC service answered.
            let host = crate::identity::tls::host_of(&self.peer);
            TcpStream::connect((host, address.port())).await.map_err(connect_err)?
        } else {
            TcpStream::connect(address).await.map_err(connect_err)?
        };
        stream.set_nodelay(true)?;
        let hello = encode_hello(&self.connection, secret);
        match &self.tls {
            None => {
                let (rd, mut wr) = stream.into_split();
                wr.write_all(&hello).await.map_err(connect_err)?;
                Ok((Box::new(rd), Box::new(wr)))
            }
            Some(tls) => {
                let name = tls.server_name_for(&self.peer).map_err(|detail| FabricError::Negotiation {
                    step: "data stream",
                    attr: "tls.server_name",
                    detail,
                })?;
                // The handshake, and with `tls.kernel = auto` the hand-over to the kernel, within
                // the handshake deadline (a drain waits on the peer for a record's end).
                let s = tokio::time::timeout(HELLO_TIMEOUT, super::ktls::connect(tls, name, stream))
                    .await
                    .map_err(|_| connect_err(std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")))?
                    .inspect_err(|_| crate::metrics::data_tls_handshake_failed("initiator"))
                    .map_err(connect_err)?;
                // The target must be an agent, not any certificate the CA signed; checked on the
                // rustls session, before the kernel takes the stream.
                match tls.caller_of(s.peer_certificates()) {
                    Ok(c) if c.role == Role::Node => {}
                    Ok(c) => {
                        return Err(FabricError::Negotiation {
                            step: "data stream",
                            attr: "certificate",
                            detail: format!("the target's certificate has the {} role, not node", c.role),
                        })
                    }
                    Err(e) => return Err(FabricError::Negotiation { step: "data stream", attr: "certificate", detail: e.to_string() }),
                }
                let (rd, mut wr) = tokio::time::timeout(HELLO_TIMEOUT, s.into_halves())
                    .await
                    .map_err(|_| connect_err(std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS hand-over to the kernel timed out")))?
                    .map_err(connect_err)?;
                wr.write_all(&hello).await.map_err(connect_err)?;
                wr.flush().await.map_err(connect_err)?;
                Ok((rd, wr))
            }
        }
    }
}

#[async_trait]
impl PendingConnection for TcpPrepared {
    fn local_endpoints(&self) -> Vec<Endpoint> {
        Vec::new()
    }

    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError> {
        let (address, secret) = match remote.first() {
            Some(Endpoint::Tcp { address, secret: Some(secret) }) => (*address, *secret),
            Some(Endpoint::Tcp { secret: None, .. }) => {
                return Err(FabricError::Negotiation {
                    step: "connect",
                    attr: "secret",
                    detail: "peer sent no data-connection secret (an agent older than this protocol?)".into(),
                })
            }
            Some(Endpoint::Verbs(_)) => {
                return Err(FabricError::Negotiation {
                    step: "connect",
                    attr: "fabric",
                    detail: "peer runs the verbs fabric; this agent runs tcp".into(),
                })
            }
            None => {
                return Err(FabricError::Negotiation {
                    step: "connect",
                    attr: "endpoints",
                    detail: "peer returned no data endpoint".into(),
                })
            }
        };
        let cancel = CancellationToken::new();
        let broken = Arc::new(AtomicBool::new(false));
        let mut qps = Vec::with_capacity(self.qps);
        for index in 0..self.qps {
            let (rd, wr) = self.open_stream(address, &secret).await?;
            qps.push(TcpQp::start(index, rd, wr, self.sink.clone(), broken.clone(), cancel.clone()));
        }
        Ok(Arc::new(TcpConnection { qps, broken, cancel }))
    }
}

struct TcpConnection {
    qps: Vec<TcpQp>,
    broken: Arc<AtomicBool>,
    cancel: CancellationToken,
}

impl Connection for TcpConnection {
    fn qps(&self) -> usize {
        self.qps.len()
    }

    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
        self.post_batch(qp, vec![wr]).map_err(|(_, e)| e)
    }

    /// The run goes to the stream's writer whole: one wake-up, and its frames leave in as few
    /// writes as they fill (one flush once nothing more is queued).
    fn post_batch(&self, qp: usize, mut wrs: Vec<WorkRequest>) -> Result<(), (u64, FabricError)> {
        let first = wrs.first().map_or(0, |w| w.wr_id);
        let q = self.qps.get(qp).ok_or((first, FabricError::NoSuchQp(qp)))?;
        // The WRs before the first that fails a check are posted; it and the rest are not.
        let refused = wrs.iter().enumerate().find_map(|(i, wr)| check_wr(wr).err().map(|e| (i, wr.wr_id, e)));
        if let Some(&(i, _, _)) = refused.as_ref() {
            wrs.truncate(i);
        }
        if !wrs.is_empty() {
            let broken = q.state.lock().map(|s| s.broken).unwrap_or(true) || self.broken.load(Ordering::Acquire);
            if broken {
                return Err((first, FabricError::QpBroken));
            }
            q.tx.send(wrs).map_err(|_| (first, FabricError::QpBroken))?;
        }
        refused.map_or(Ok(()), |(_, id, e)| Err((id, e)))
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.broken.store(true, Ordering::Release);
        self.cancel.cancel();
    }
}

/// What a WR must be to go on a tcp stream: a token grant, a local range inside its
/// registration, and writable memory for a READ.
fn check_wr(wr: &WorkRequest) -> Result<(), FabricError> {
    if !matches!(wr.remote_key, RemoteKey::Token(_)) {
        return Err(FabricError::BadRemoteKey);
    }
    wr.local.memory().check(wr.local_offset, wr.len as u64).map_err(|e| FabricError::LocalRange(e.to_string()))?;
    if wr.op == WrOp::Read && !wr.local.memory().writable() {
        return Err(FabricError::LocalRange("READ into read-only memory".into()));
    }
    Ok(())
}

impl Drop for TcpConnection {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    use tokio::io::AsyncReadExt;
    use tokio_util::sync::CancellationToken;
    use xfer_rdma::memory::RegionMemory;

    use super::{TcpConnection, TcpQp};
    use crate::frame::{Header, Kind, HEADER_LEN};
    use crate::{Access, Connection, FabricError, RemoteKey, WorkRequest, WrOp};

    /// A run whose third WR names memory outside its registration: the two before it go out
    /// (as one run, in order), the refusal names the third, and neither it nor the fourth is
    /// sent, as the driver's `post_runs` expects of every fabric.
    #[tokio::test]
    async fn a_run_is_posted_up_to_its_first_bad_wr_and_the_refusal_names_it() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 20);
        let (rd, wr) = tokio::io::split(ours);
        let (sink, _completions) = tokio::sync::mpsc::unbounded_channel();
        let (broken, cancel) = (Arc::new(AtomicBool::new(false)), CancellationToken::new());
        let qp = TcpQp::start(0, Box::new(rd), Box::new(wr), sink, broken.clone(), cancel.clone());
        let conn = TcpConnection { qps: vec![qp], broken, cancel };
        let local = crate::tcp::registration(Arc::new(RegionMemory::anonymous(4096, false).expect("a page")), Access::ReadWrite);
        let work = |wr_id, local_offset| WorkRequest {
            wr_id,
            op: WrOp::Write,
            local: local.clone(),
            local_offset,
            len: 16,
            remote_addr: 0,
            remote_key: RemoteKey::Token([7; 16]),
            signaled: false,
        };
        let run = vec![work(1, 0), work(2, 16), work(3, 1 << 20), work(4, 32)];
        let refused = conn.post_batch(0, run);
        assert!(matches!(refused, Err((3, FabricError::LocalRange(_)))), "{refused:?}");
        let mut ids = Vec::new();
        for _ in 0..2 {
            let mut f = [0u8; HEADER_LEN + 16];
            theirs.read_exact(&mut f).await.expect("a frame");
            let h = Header::decode(f[..HEADER_LEN].try_into().expect("a header")).expect("decodes");
            assert_eq!(h.kind, Kind::Write);
            ids.push(h.id);
        }
        assert_eq!(ids, vec![1, 2]);
        // Nothing else was written: once the connection closes, the stream ends right here.
        conn.close();
        drop(conn);
        let mut rest = Vec::new();
        theirs.read_to_end(&mut rest).await.expect("the stream ends");
        assert!(rest.is_empty(), "{} more bytes: a WR after the refused one went out", rest.len());
    }
}
