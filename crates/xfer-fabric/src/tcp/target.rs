//! The target's data listener: accepts sockets within the data-port limits, runs each stream's
//! (TLS handshake and) hello, admits it to its connection's session and serves its frames.
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWrite;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::hello::read_hello;
use super::limits::{DataLimits, PreHelloSlot, PreHelloSockets};
use super::serve::{refuse, serve_frames_idle, ServeError, StreamTimers};
use super::session::{DataSessions, Refusal};
use crate::grant::AccessCheck;
use crate::identity::tls::DataTls;
use crate::identity::Role;
use crate::WcStatus;
use xfer_engine::ids::ConnectionId;
use xfer_rdma::scatter::ScatterRead;

#[derive(Clone)]
pub(super) struct ServeCtx {
    pub(super) check: Arc<dyn AccessCheck>,
    pub(super) sessions: Arc<DataSessions>,
    pub(super) tls: Option<DataTls>,
    pub(super) shutdown: CancellationToken,
    pub(super) limits: DataLimits,
    /// Open sockets on the data port (`limits.max_data_connections`), from accept until close.
    pub(super) open: Arc<crate::accept::Slots>,
    pub(super) pre_hello: Arc<PreHelloSockets>,
    /// Every session is the standby rail of another fabric's connection
    /// ([`super::Serving::StandbyRails`]): its streams are not closed for idleness.
    pub(super) standby: bool,
}

pub(super) async fn serve(listener: TcpListener, ctx: ServeCtx) {
    let mut backoff = crate::accept::AcceptBackoff::default();
    loop {
        let accepted = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, from)) => {
                backoff.succeeded();
                // Counted from accept until the socket closes: a flood of silent sockets cannot
                // take more than the cap (and the hello deadline reclaims them).
                let Some(slot) = ctx.open.take() else {
                    crate::metrics::data_connection_refused("total");
                    debug!(%from, max = ctx.limits.max_connections, "tcp fabric: data connection refused (limits.max_data_connections)");
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let ctx = ctx.clone();
                let pending = ctx.pre_hello.enter();
                tokio::spawn(async move {
                    if let Err(e) = serve_stream(stream, pending, &ctx).await {
                        debug!(%from, error = %e, "tcp fabric: data stream ended");
                    }
                    drop(slot);
                });
            }
            Err(e) => {
                // EMFILE/ENFILE: the listener stays readable, so retrying at once would spin.
                let pause = backoff.failed("data");
                warn!(error = %e, ?pause, "tcp fabric: accept failed; backing off");
                tokio::select! {
                    _ = ctx.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}

/// One data stream: (TLS handshake,) hello within `limits.data_handshake_timeout`, then frames
/// until the stream, its session or the fabric ends, or it idles for `limits.data_idle_timeout`.
async fn serve_stream(stream: TcpStream, pending: PreHelloSlot, ctx: &ServeCtx) -> Result<(), ServeError> {
    let deadline = ctx.limits.handshake_timeout;
    let late = || {
        crate::metrics::data_connection_closed("handshake");
    };
    match &ctx.tls {
        None => {
            let (mut rd, mut wr) = stream.into_split();
            let hello = match before_hello(&pending, deadline, read_hello(&mut rd)).await {
                Some(Ok(h)) => h,
                Some(Err(e)) => {
                    refuse(&mut wr, 0, WcStatus::RemInvReqErr).await;
                    return Err(e);
                }
                None => {
                    late();
                    return Err(ServeError::Hello("no hello in time"));
                }
            };
            drop(pending);
            serve_session(rd, wr, hello, None, ctx).await
        }
        Some(tls) => {
            // The handshake, the identity (taken from the rustls session, before the kernel may
            // take the stream), the hand-over (`tls.kernel = auto`) and the hello, all within
            // the handshake deadline.
            let handshake = async {
                let s = super::ktls::accept(tls, stream).await.inspect_err(|_| crate::metrics::data_tls_handshake_failed("target"))?;
                let who = tls.caller_of(s.peer_certificates()).ok().filter(|c| c.role == Role::Node).map(|c| c.name);
                let (mut rd, wr) = s.into_halves().await?;
                let hello = read_hello(&mut rd).await?;
                Ok::<_, ServeError>((rd, wr, who, hello))
            };
            let (rd, mut wr, who, hello) = before_hello(&pending, deadline, handshake).await.ok_or_else(|| {
                late();
                ServeError::Hello("no TLS handshake and hello in time")
            })??;
            drop(pending);
            let Some(who) = who else {
                refuse(&mut wr, 0, WcStatus::RemAccessErr).await;
                return Err(ServeError::Hello("data streams need a node certificate"));
            };
            serve_session(rd, wr, hello, Some(who), ctx).await
        }
    }
}

/// Runs a stream's (TLS handshake and) hello until `deadline` (`None`) or until a newer socket
/// evicts this one from the [`PreHelloSockets`] (an error).
async fn before_hello<T>(
    pending: &PreHelloSlot,
    deadline: Duration,
    hello: impl std::future::Future<Output = Result<T, ServeError>>,
) -> Option<Result<T, ServeError>> {
    tokio::select! {
        _ = pending.token.cancelled() => Some(Err(ServeError::Hello(
            "closed before its hello to make room for a newer socket (limits.max_pending_data_connections)"
        ))),
        r = tokio::time::timeout(deadline, hello) => r.ok(),
    }
}

async fn serve_session<R, W>(
    rd: R,
    mut wr: W,
    hello: (ConnectionId, [u8; 32]),
    identity: Option<String>,
    ctx: &ServeCtx,
) -> Result<(), ServeError>
where
    R: ScatterRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (connection, secret) = hello;
    let (closed, owner) = match ctx.sessions.admit(&connection, &secret, identity.as_deref()) {
        Ok(c) => c,
        Err(why) => {
            refuse(&mut wr, 0, WcStatus::RemAccessErr).await;
            return Err(match why {
                Refusal::Hello(why) => ServeError::Hello(why),
                Refusal::PerPeer => {
                    crate::metrics::data_connection_refused("per_peer");
                    ServeError::Hello("too many data streams from this identity (limits.max_data_connections_per_peer)")
                }
            });
        }
    };
    let timers = StreamTimers {
        // A standby rail idles by design until every RDMA path of its connection is lost, and
        // must then be there: it lives as long as that connection's session, which closes it.
        idle: (!ctx.standby).then_some(ctx.limits.idle_timeout),
        stall: Some(ctx.limits.idle_timeout),
        payload: Some(ctx.limits.payload_timeout),
    };
    let r = tokio::select! {
        _ = ctx.shutdown.cancelled() => Ok(()),
        _ = closed.cancelled() => Ok(()),
        r = serve_frames_idle(rd, wr, &*ctx.check, &connection, timers) => r,
    };
    ctx.sessions.stream_ended(&connection, &owner);
    match r {
        Err(ServeError::Idle) => crate::metrics::data_connection_closed("idle"),
        Err(ServeError::PayloadTimeout) => crate::metrics::data_connection_closed("payload"),
        Err(ServeError::Revoked) => crate::metrics::data_connection_closed("revoked"),
        Err(ServeError::Stalled) => crate::metrics::data_connection_closed("stalled"),
        _ => {}
    }
    r
}
