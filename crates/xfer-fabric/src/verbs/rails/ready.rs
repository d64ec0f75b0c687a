//! The responder's readiness of a connection over several devices, from its parts'. Each part
//! moves its QPs to RTR and RTS after the answer went out; one that cannot (its device has no
//! route back to the initiator's: a link going down before its port-down event arrived) is left
//! as it is, its QPs in ERR, so nothing lands there, while the connection is usable on the
//! others. The initiator's half of that rail either met the same failure (and left the rail
//! dead) or loses that path at its first work request, which the transfer machine survives.
//! So the connection is ready once every part has settled and one is ready; it fails only when
//! every part failed.
use tokio::sync::watch::Receiver;

use crate::Readiness;

/// One part's readiness, named by its device (for the log and the metric).
pub(crate) struct PartReady {
    pub device: String,
    /// `None` for a part that is usable as soon as it is answered.
    pub ready: Option<Receiver<Readiness>>,
}

/// Why a part whose set-up ended without a word failed.
const DROPPED: &str = "the connection was dropped before it was ready";

/// Waits until every part has settled. Ready when at least one is, with the devices whose parts
/// failed and why (in part order); else `Failed` with the first part's reason.
pub(crate) async fn combine(parts: Vec<PartReady>) -> (Readiness, Vec<(String, String)>) {
    let mut failed = Vec::new();
    let mut any_ready = false;
    for PartReady { device, ready } in parts {
        let Some(mut ready) = ready else {
            any_ready = true;
            continue;
        };
        let outcome = match ready.wait_for(|r| *r != Readiness::Pending).await {
            Ok(r) => r.clone(),
            Err(_) => Readiness::Failed(DROPPED.into()),
        };
        match outcome {
            Readiness::Failed(why) => failed.push((device, why)),
            _ => any_ready = true,
        }
    }
    if any_ready {
        return (Readiness::Ready, failed);
    }
    let why = failed.first().map(|(_, why)| why.clone()).unwrap_or_else(|| "the connection has no device part".into());
    (Readiness::Failed(why), failed)
}

/// The connection's readiness over `parts`, settled by a task of its own ([`combine`]); a part
/// that failed while others are ready is logged and counted (`xfer_rail_connect_failures_total`).
pub(crate) fn combined(parts: Vec<PartReady>, peer: String, connection: String) -> Receiver<Readiness> {
    let (tx, rx) = tokio::sync::watch::channel(Readiness::Pending);
    tokio::spawn(async move {
        let (outcome, failed) = combine(parts).await;
        if outcome == Readiness::Ready {
            for (device, why) in &failed {
                tracing::warn!(%device, %peer, %connection, error = %why,
                    "this device's responder QPs could not be moved to RTS: the connection goes on without this rail");
                crate::metrics::rail_connect_failure(device, "responder");
            }
        }
        tx.send_replace(outcome);
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::watch::{channel, Sender};

    fn part(device: &str) -> (Sender<Readiness>, PartReady) {
        let (tx, rx) = channel(Readiness::Pending);
        (tx, PartReady { device: device.into(), ready: Some(rx) })
    }

    #[tokio::test]
    async fn every_part_ready_is_ready() {
        let (a, pa) = part("rxe0");
        let (b, pb) = part("rxe2");
        a.send_replace(Readiness::Ready);
        b.send_replace(Readiness::Ready);
        assert_eq!(combine(vec![pa, pb]).await, (Readiness::Ready, vec![]));
    }

    #[tokio::test]
    async fn one_failed_part_leaves_the_connection_ready_on_the_others() {
        for failing in 0..2 {
            let (a, pa) = part("rxe0");
            let (b, pb) = part("rxe2");
            let (bad, good) = if failing == 0 { (&a, &b) } else { (&b, &a) };
            bad.send_replace(Readiness::Failed("RTR: dgid: ibv_modify_qp: Network is unreachable".into()));
            good.send_replace(Readiness::Ready);
            let (r, failed) = combine(vec![pa, pb]).await;
            assert_eq!(r, Readiness::Ready);
            let device = if failing == 0 { "rxe0" } else { "rxe2" };
            assert_eq!(failed, vec![(device.to_string(), "RTR: dgid: ibv_modify_qp: Network is unreachable".to_string())]);
        }
    }

    #[tokio::test]
    async fn every_part_failed_fails_with_the_first_reason() {
        let (a, pa) = part("rxe0");
        let (b, pb) = part("rxe2");
        a.send_replace(Readiness::Failed("first".into()));
        b.send_replace(Readiness::Failed("second".into()));
        let (r, failed) = combine(vec![pa, pb]).await;
        assert_eq!(r, Readiness::Failed("first".into()));
        assert_eq!(failed.len(), 2);
    }

    /// A part whose set-up ended without a result counts as failed: alone it fails the
    /// connection; next to a ready part it is left out.
    #[tokio::test]
    async fn a_dropped_part_counts_as_failed() {
        let (a, pa) = part("rxe0");
        drop(a);
        let (r, _) = combine(vec![pa]).await;
        assert_eq!(r, Readiness::Failed(DROPPED.into()));
        let (a, pa) = part("rxe0");
        let (b, pb) = part("rxe2");
        drop(a);
        b.send_replace(Readiness::Ready);
        let (r, failed) = combine(vec![pa, pb]).await;
        assert_eq!(r, Readiness::Ready);
        assert_eq!(failed, vec![("rxe0".to_string(), DROPPED.to_string())]);
        // A part without readiness is usable at once; no part at all is no connection.
        assert_eq!(combine(vec![PartReady { device: "x".into(), ready: None }]).await.0, Readiness::Ready);
        assert!(matches!(combine(vec![]).await.0, Readiness::Failed(_)));
    }

    /// The combination waits for every part to settle: a part ready early does not make the
    /// connection ready while another is still pending, and the task publishes once all settled.
    #[tokio::test]
    async fn readiness_waits_for_every_part() {
        let (a, pa) = part("rxe0");
        let (b, pb) = part("rxe2");
        let mut rx = combined(vec![pa, pb], "peer".into(), "c1".into());
        a.send_replace(Readiness::Ready);
        tokio::task::yield_now().await;
        assert_eq!(*rx.borrow(), Readiness::Pending, "one part is still moving its QPs");
        b.send_replace(Readiness::Failed("no route".into()));
        let r = rx.wait_for(|r| *r != Readiness::Pending).await.unwrap().clone();
        assert_eq!(r, Readiness::Ready);
    }
}
