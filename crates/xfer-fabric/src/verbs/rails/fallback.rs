//! The tcp fallback rail of a [`super::RailsFabric`] (`transfer.fallback = tcp`): the agent's tcp
//! fabric carried as one more, last rail of every verbs connection, a standby path
//! (`PathInfo::standby`) the transfer machine uses only when no verbs path is up.
//!
//! * Negotiation: the initiator adds [`Endpoint::tcp_fallback_request`] to its verbs endpoints;
//!   a responder with a fallback accepts it on its tcp fabric under the *same* connection id (so
//!   grants, markers and window lookups need no mapping) and answers its tcp endpoint; one
//!   without leaves it out, and the initiator logs once per peer that the peer has none.
//! * Keys: a grant on a connection with a tcp rail is `RemoteKey::Each`: one rkey per verbs QP in
//!   connection order, then the tcp token once. The responder does not know how many streams the
//!   initiator opens, so the last key, a token, serves every QP of the tcp rail ([`key_for`]).
//! * Completions: the tcp child's sink is forwarded into the connection's sink with the rail's
//!   QP offset by a small task, which also wakes the data-path worker the connection is handed to.
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::register::RailsRegistration;
use crate::{
    Completion, CompletionSink, Connection, Endpoint, Fabric, FabricError, PendingConnection, Registration, RemoteKey, WorkRequest,
};

/// The tcp fabric a verbs fabric falls back to, and the peers already told to have none.
pub(crate) struct Fallback {
    pub fabric: Arc<dyn Fabric>,
    /// Peers whose missing fallback was logged (once per peer).
    told: Mutex<HashSet<String>>,
}

impl Fallback {
    pub fn new(fabric: Arc<dyn Fabric>) -> Fallback {
        Fallback { fabric, told: Mutex::default() }
    }

    /// Logs, once per peer, that `peer` answered no tcp rail.
    pub fn peer_has_none(&self, peer: &str) {
        if self.told.lock().unwrap_or_else(|e| e.into_inner()).insert(peer.to_string()) {
            tracing::warn!(%peer, "the peer offers no tcp fallback (its transfer.fallback is never, or it runs one device without it): \
                 connections to it have no standby path if every RDMA path fails");
        }
    }
}

/// The initiator's tcp rail between `prepare` and the answer.
pub(crate) struct PendingTcp {
    pub pending: Box<dyn PendingConnection>,
    /// The tcp child's completions (its QP indices are its own, from 0).
    pub completions: mpsc::UnboundedReceiver<Completion>,
}

impl PendingTcp {
    /// Prepares `qps` streams on the fallback fabric under `connection_id`.
    pub async fn prepare(
        fallback: &Fallback,
        peer: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
        qps: usize,
        depth: usize,
    ) -> Result<PendingTcp, FabricError> {
        let (sink, completions) = mpsc::unbounded_channel();
        let pending = fallback.fabric.prepare(peer, connection_id, qps, depth, sink).await?;
        Ok(PendingTcp { pending, completions })
    }

    /// Opens the streams to the responder's tcp endpoint and forwards their completions to
    /// `sink` with `base` added to each QP index.
    pub async fn complete(self, answer: &Endpoint, base: usize, sink: CompletionSink) -> Result<TcpRail, FabricError> {
        let conn = self.pending.complete(std::slice::from_ref(answer)).await?;
        let wake: Arc<Mutex<Option<std::thread::Thread>>> = Arc::default();
        let mut completions = self.completions;
        let to = Arc::clone(&wake);
        tokio::spawn(async move {
            // Ends when the tcp child's streams are gone (closed or dropped with the connection).
            while let Some(mut c) = completions.recv().await {
                c.qp += base;
                if sink.send(c).is_err() {
                    break;
                }
                if let Some(t) = to.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                    t.unpark();
                }
            }
        });
        Ok(TcpRail { qps: conn.qps(), conn, base, wake })
    }
}

/// The tcp rail of an established connection.
pub(crate) struct TcpRail {
    pub conn: Arc<dyn Connection>,
    /// The connection's index of the rail's first QP (after every verbs rail's).
    pub base: usize,
    pub qps: usize,
    /// The data-path worker the connection is handed to, woken on each forwarded completion.
    wake: Arc<Mutex<Option<std::thread::Thread>>>,
}

impl TcpRail {
    pub fn hand_off(&self, to: Option<std::thread::Thread>) {
        *self.wake.lock().unwrap_or_else(|e| e.into_inner()) = to;
    }

    /// `wr` as the tcp child takes it: the tcp registration of the local memory and the token.
    pub fn translate(&self, mut wr: WorkRequest, qp: usize) -> Result<WorkRequest, FabricError> {
        if let Some(ours) = wr.local.as_any().downcast_ref::<RailsRegistration>() {
            let part: Arc<dyn Registration> = ours
                .tcp_part()
                .cloned()
                .ok_or_else(|| FabricError::Registration("the registration has no part on the tcp fallback".into()))?;
            wr.local = part;
        }
        wr.remote_key = key_for(&wr.remote_key, qp)?;
        Ok(wr)
    }
}

/// The key connection QP `qp` uses out of a grant's key: of `Each`, key `qp`, or past the list's
/// end its last key if that is a token (the tcp rail's, serving all its QPs); of `PerQp`, key
/// `qp` as an rkey; any other key as it is.
pub(crate) fn key_for(key: &RemoteKey, qp: usize) -> Result<RemoteKey, FabricError> {
    match key {
        RemoteKey::Each(keys) => keys
            .get(qp)
            .or_else(|| keys.last().filter(|k| matches!(k, RemoteKey::Token(_))))
            .cloned()
            .ok_or_else(|| FabricError::Other(format!("the grant has {} per-QP keys and none for QP {qp}", keys.len()))),
        RemoteKey::PerQp(keys) => keys
            .get(qp)
            .map(|k| RemoteKey::Rkey(*k))
            .ok_or_else(|| FabricError::Other(format!("the grant has {} per-QP keys and none for QP {qp}", keys.len()))),
        other => Ok(other.clone()),
    }
}

/// Splits a peer's endpoints into the verbs ones and its tcp endpoint, if any (a fallback
/// request, or a responder's answer).
pub(crate) fn split(remote: &[Endpoint]) -> (Vec<Endpoint>, Option<Endpoint>) {
    let mut verbs = Vec::with_capacity(remote.len());
    let mut tcp = None;
    for e in remote {
        match e {
            Endpoint::Tcp { .. } => tcp = Some(e.clone()),
            Endpoint::Verbs(_) => verbs.push(e.clone()),
        }
    }
    (verbs, tcp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VerbsEndpoint;

    #[test]
    fn each_key_serves_its_qp_and_the_token_every_tcp_qp() {
        let keys: Arc<[RemoteKey]> = vec![RemoteKey::Rkey(10), RemoteKey::Rkey(11), RemoteKey::Token([7; 16])].into();
        let each = RemoteKey::Each(keys);
        assert!(key_for(&each, 1).unwrap() == RemoteKey::Rkey(11));
        // The tcp rail's QPs 2, 3, 4 all take the token.
        for qp in 2..5 {
            assert!(key_for(&each, qp).unwrap() == RemoteKey::Token([7; 16]));
        }
        // Without a token at the end there is nothing past the list.
        let verbs_only = RemoteKey::Each(vec![RemoteKey::Rkey(1)].into());
        assert!(key_for(&verbs_only, 1).is_err());
        assert!(key_for(&RemoteKey::PerQp(vec![5, 6].into()), 1).unwrap() == RemoteKey::Rkey(6));
        assert!(key_for(&RemoteKey::Rkey(9), 3).unwrap() == RemoteKey::Rkey(9));
    }

    #[test]
    fn the_fallback_request_is_told_apart_from_verbs_endpoints_and_real_tcp_answers() {
        let req = Endpoint::tcp_fallback_request();
        assert!(req.is_tcp_fallback_request());
        let answer = Endpoint::Tcp { address: "127.0.0.1:4000".parse().unwrap(), secret: Some(crate::DataSecret([1; 32])) };
        assert!(!answer.is_tcp_fallback_request());
        let v = Endpoint::Verbs(VerbsEndpoint { qpn: 3, ..Default::default() });
        let (verbs, tcp) = split(&[v.clone(), req.clone(), v.clone()]);
        assert_eq!((verbs.len(), tcp), (2, Some(req)));
        assert_eq!(split(&[v]).1, None);
    }
}
