//! End-to-end checks a peer asks of this agent as a transfer's target: the spans a checksum
//! covers (a batch's segments, in order), checked against their grant before any memory is read,
//! and a channel batch verified after its initiator failed over (`Peer.VerifyBatch`), whose
//! notification is then published here rather than by its held-back markers.
use std::time::SystemTime;

use super::Node;
use crate::checksum::{self, Algo};
use crate::error::NodeError;
use crate::grants::Grant;

impl Node {
    /// `Peer.VerifyBatch`: the checksum of `spans` of `peer`'s grant `grant_id` (offsets from
    /// the grant's start, read in order) against `sum`; with `settle` and a match, batch `seq`'s
    /// notification is published as if its markers had all arrived. `(matched, this agent's sum)`.
    pub async fn verify_batch(
        &self,
        grant_id: &str,
        peer: &str,
        seq: u64,
        sum: (Algo, u64),
        spans: &[(u64, u64)],
        settle: bool,
    ) -> Result<(bool, u64), NodeError> {
        let g = self.regions.grants.get(grant_id, peer, SystemTime::now())?;
        let bytes = spans.iter().fold(0u64, |t, s| t.saturating_add(s.1));
        let Some(ranges) = checked_spans(spans, bytes, g.len)? else {
            return Err(NodeError::Invalid("spans are required: they say what the checksum covers".into()));
        };
        let (algo, expected) = sum;
        let got = grant_checksum(&g, &ranges, algo).await?;
        let matched = got == expected;
        if matched && settle {
            self.regions.grants.settle(grant_id, peer, seq)?;
        }
        Ok((matched, got))
    }
}

/// The checksum of `ranges` of grant `g` (offsets from the grant's start, checked), read in order
/// on the blocking pool.
pub(super) async fn grant_checksum(g: &Grant, ranges: &[(u64, u64)], algo: Algo) -> Result<u64, NodeError> {
    let mem = g.region.memory.clone();
    let ranges: Vec<(u64, u64)> = ranges.iter().map(|&(o, l)| (g.offset + o, l)).collect();
    tokio::task::spawn_blocking(move || checksum::checksum_ranges(&mem, &ranges, algo))
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?
        .map_err(|e| NodeError::Region(g.region.mem_error(e)))
}

/// How many times over its grant a completion's spans may read (see [`checked_spans`]).
const MAX_SPAN_PASSES: u64 = 4;

/// A completion's spans, checked against its grant before any memory is read: each inside the
/// grant (`offset + length <= grant_len`, no overflow), none empty, their lengths adding up to
/// `bytes`. `None` when there are none (the checksum covers the grant's first `bytes`).
pub(super) fn checked_spans(spans: &[(u64, u64)], bytes: u64, grant_len: u64) -> Result<Option<Vec<(u64, u64)>>, NodeError> {
    if spans.is_empty() {
        return Ok(None);
    }
    let mut total = 0u64;
    for (i, &(off, len)) in spans.iter().enumerate() {
        let end = off.checked_add(len).filter(|&e| e <= grant_len && len > 0);
        if end.is_none() {
            return Err(NodeError::Invalid(format!("span {i}: {len} bytes at {off} are empty or outside the grant's {grant_len} bytes")));
        }
        total = total.saturating_add(len);
    }
    // A READ batch may read one block more than once, so the spans may add up to more than the
    // grant; but the sum is work this agent does on a peer's word: bounded to a few passes.
    if total > grant_len.saturating_mul(MAX_SPAN_PASSES) {
        return Err(NodeError::Invalid(format!(
            "spans add up to {total} bytes, more than {MAX_SPAN_PASSES} passes over the grant's {grant_len} bytes"
        )));
    }
    if total != bytes {
        return Err(NodeError::Invalid(format!("spans add up to {total} bytes, the completion says {bytes}")));
    }
    Ok(Some(spans.to_vec()))
}
