//! The target's data-plane sessions: one per accepted connection (its owner, its secret, its
//! open streams), and the admission of each data stream that names one in its hello.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::{Accepted, DataSecret};
use xfer_engine::ids::ConnectionId;

/// Most data streams one connection may open (`transfer.qps` is at most 64).
const MAX_STREAMS_PER_SESSION: usize = 64;

/// One connection's data-plane session on the target: who made it, its secret, and a token that
/// closes its streams when the connection goes away.
pub(super) struct DataSession {
    pub(super) owner: String,
    pub(super) secret: DataSecret,
    pub(super) streams: usize,
    pub(super) closed: CancellationToken,
}

/// Data sessions by connection id, and open streams by owner. std Mutex: map operations only, never
/// held across an await.
pub(super) struct DataSessions {
    map: Mutex<DataSessionMaps>,
    max_per_owner: usize,
}

#[derive(Default)]
pub(super) struct DataSessionMaps {
    pub(super) sessions: HashMap<ConnectionId, DataSession>,
    /// Admitted streams per owner, across all of its sessions.
    per_owner: HashMap<String, usize>,
}

/// Why a hello was refused; `PerPeer` is counted apart in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    Hello(&'static str),
    PerPeer,
}

impl DataSessions {
    pub(super) fn new(max_per_owner: usize) -> Self {
        DataSessions { map: Mutex::new(DataSessionMaps::default()), max_per_owner }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, DataSessionMaps> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits one more stream of `connection` presenting `secret` from `identity` (TLS: the client
    /// certificate's NAME; plaintext: None). Returns the token that ends the stream with the
    /// session, and the session's owner (for [`DataSessions::stream_ended`]).
    pub(super) fn admit(
        &self,
        connection: &ConnectionId,
        secret: &[u8; 32],
        identity: Option<&str>,
    ) -> Result<(CancellationToken, String), Refusal> {
        use subtle::ConstantTimeEq;
        let mut maps = self.lock();
        let DataSessionMaps { sessions, per_owner } = &mut *maps;
        let s = sessions.get_mut(connection).ok_or(Refusal::Hello("unknown connection"))?;
        if !bool::from(s.secret.0.ct_eq(secret)) {
            return Err(Refusal::Hello("wrong connection secret"));
        }
        if identity.is_some_and(|id| id != s.owner) {
            return Err(Refusal::Hello("the client certificate is not the identity that made the connection"));
        }
        if s.streams >= MAX_STREAMS_PER_SESSION {
            return Err(Refusal::Hello("too many streams on this connection"));
        }
        let owned = per_owner.entry(s.owner.clone()).or_insert(0);
        if *owned >= self.max_per_owner {
            return Err(Refusal::PerPeer);
        }
        *owned += 1;
        s.streams += 1;
        Ok((s.closed.clone(), s.owner.clone()))
    }

    /// A stream admitted for `owner` on `connection` ended (its session may be gone already).
    pub(super) fn stream_ended(&self, connection: &ConnectionId, owner: &str) {
        let mut maps = self.lock();
        if let Some(s) = maps.sessions.get_mut(connection) {
            s.streams = s.streams.saturating_sub(1);
        }
        if let Some(n) = maps.per_owner.get_mut(owner) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                maps.per_owner.remove(owner);
            }
        }
    }
}

/// The responder's half of a tcp connection: its session. Dropping it (disconnect) forgets the
/// secret and closes every stream of the connection.
pub(super) struct TcpAccepted {
    pub(super) sessions: Arc<DataSessions>,
    pub(super) connection: ConnectionId,
}

impl Accepted for TcpAccepted {}

impl Drop for TcpAccepted {
    fn drop(&mut self) {
        if let Some(s) = self.sessions.lock().sessions.remove(&self.connection) {
            s.closed.cancel();
        }
    }
}
