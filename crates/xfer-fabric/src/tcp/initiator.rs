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
                let connector = tokio_rustls::TlsConnector::from(tls.client.clone());
                let mut s = tokio::time::timeout(HELLO_TIMEOUT, connector.connect(name, super::wire::tls_socket(stream)))
                    .await
                    .map_err(|_| connect_err(std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")))?
                    .inspect_err(|_| crate::metrics::data_tls_handshake_failed("initiator"))
                    .map_err(connect_err)?;
                // The target must be an agent, not any certificate the CA signed.
                match tls.caller_of(s.get_ref().1.peer_certificates()) {
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
                s.write_all(&hello).await.map_err(connect_err)?;
                let (rd, wr) = tokio::io::split(s);
                Ok((Box::new(rd), Box::new(wr)))
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
