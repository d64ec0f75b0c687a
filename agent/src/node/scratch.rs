//! The target side of a benchmark: one scratch region at a time for the peer running it
//! (`Peer.OpenBenchRegion`/`CloseBenchRegion`), its bytes in `limits.max_bench_bytes` and its
//! lease bounded by [`BENCH_REGION_TTL`].
use std::time::Duration;

use super::Node;
use crate::error::NodeError;
use xfer_engine::ids::new_id;

/// A benchmark's scratch region on the target is reaped after this at the latest.
pub const BENCH_REGION_TTL: Duration = Duration::from_secs(600);

impl Node {
    /// `Peer.OpenBenchRegion`: the target side of a benchmark, a scratch region for `owner`. One
    /// at a time per agent; the region's bytes come from `limits.max_bench_bytes` (not from the
    /// clients' region limits) and its lease ends after [`BENCH_REGION_TTL`] even if the caller
    /// never closes it.
    pub fn open_bench_region(&self, owner: &str, length: u64) -> Result<String, NodeError> {
        xfer_engine::shape::bench_region(length)?;
        let mut slot = self.regions.bench_region.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((name, _)) = slot.as_ref() {
            if self.regions.registry.get(name).is_ok() {
                return Err(NodeError::Limit("a benchmark against this agent is already running (one at a time)".into()));
            }
        }
        let name = format!("xfer-bench-{}", new_id());
        let budget = self.regions.registry.reserve_bench(length, "a benchmark scratch region")?;
        let mut labels: std::collections::BTreeMap<String, String> = [("xfer.io/scratch".to_string(), "bench".to_string())].into();
        // A NAME can be longer than a label value (or an address, in plaintext): shown only
        // when it is one.
        if crate::labels::check_value("xfer.io/owner", owner).is_ok() {
            labels.insert("xfer.io/owner".to_string(), owner.to_string());
        }
        let spec = crate::regions::RegionSpec {
            ttl: Some(BENCH_REGION_TTL),
            labels,
            ..crate::regions::RegionSpec::anonymous(&name, length, xfer_fabric::Access::ReadWrite)
        };
        self.regions.registry.create_scratch(spec, budget)?;
        *slot = Some((name.clone(), owner.to_string()));
        Ok(name)
    }

    /// `Peer.CloseBenchRegion`: deletes the caller's scratch region (no-op for anything else).
    pub fn close_bench_region(&self, owner: &str, name: &str) -> Result<(), NodeError> {
        let mut slot = self.regions.bench_region.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            Some((n, o)) if n == name && o == owner => {
                let n = n.clone();
                *slot = None;
                drop(slot);
                match self.delete_region(&n) {
                    Ok(()) | Err(crate::regions::RegionError::NotFound(_)) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
            _ => Err(crate::regions::RegionError::NotFound(name.to_string()).into()),
        }
    }
}
