//! The bounds of a transfer's shape — chunk size, QPs per connection, window depth — in one place,
//! used by configuration validation, `SubmitTransfer`, `Agent.Connect` and the benchmark, so the
//! numbers and their messages cannot drift apart.
use std::ops::RangeInclusive;

/// Largest chunk (one work request). The tcp fabric's frame payload bound; verbs uses the same
/// ceiling so a transfer's shape is valid on either fabric.
pub const MAX_CHUNK: u64 = crate::frame::MAX_PAYLOAD as u64;
/// QPs (tcp: data streams) per connection a transfer may ask for.
pub const QPS: RangeInclusive<usize> = 1..=64;
/// Endpoints one `Peer.Connect` offer may carry: a peer refuses more (RESOURCE_EXHAUSTED). A
/// connection over several devices offers its QPs on each device, plus one endpoint for a tcp
/// fallback rail, so `qps` × devices must fit ([`connection_endpoints`]).
pub const MAX_ENDPOINTS: usize = 64;
/// Work requests outstanding per QP.
pub const DEPTH: RangeInclusive<usize> = 1..=4096;

/// A shape value out of its bounds; the message names the bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("chunk size must be between 1 and {MAX_CHUNK} bytes")]
    Chunk,
    #[error("qps must be {}-{}", QPS.start(), QPS.end())]
    Qps,
    #[error("depth must be {}-{}", DEPTH.start(), DEPTH.end())]
    Depth,
    #[error("size must be between 1 and {MAX_CHUNK} bytes")]
    Size,
    #[error("a benchmark pool must be between 1 and {MAX_BENCH_POOL} bytes")]
    Pool,
}

/// Largest scratch region a benchmark asks a peer for (the KV pattern's pool); the region
/// limits (`max_registered_bytes`) apply on top.
pub const MAX_BENCH_POOL: u64 = 64 << 30;

/// A benchmark's scratch region on the target: one message, or the KV pattern's pool.
pub fn bench_region(n: u64) -> Result<u64, ShapeError> {
    if (1..=MAX_BENCH_POOL).contains(&n) {
        Ok(n)
    } else {
        Err(ShapeError::Pool)
    }
}

pub fn chunk(n: u64) -> Result<u64, ShapeError> {
    if (1..=MAX_CHUNK).contains(&n) {
        Ok(n)
    } else {
        Err(ShapeError::Chunk)
    }
}

/// The endpoints a connection of `qps` QPs per device over `devices` devices (and a tcp fallback
/// rail's request, `fallback`) offers, or why a peer would refuse that many: the message names
/// both numbers and the most QPs per device that fit.
pub fn connection_endpoints(qps: usize, devices: usize, fallback: bool) -> Result<usize, String> {
    let devices = devices.max(1);
    let total = qps.saturating_mul(devices).saturating_add(usize::from(fallback));
    if total <= MAX_ENDPOINTS {
        return Ok(total);
    }
    let fits = (MAX_ENDPOINTS - usize::from(fallback)) / devices;
    let tcp = if fallback { " + 1 for the tcp fallback" } else { "" };
    Err(format!(
        "{qps} QPs × {devices} devices{tcp} = {total} endpoints in one connection offer, and a peer accepts at most \
         {MAX_ENDPOINTS}: use at most {fits} QPs with {devices} devices, or fewer devices"
    ))
}

pub fn qps(n: usize) -> Result<usize, ShapeError> {
    if QPS.contains(&n) {
        Ok(n)
    } else {
        Err(ShapeError::Qps)
    }
}

pub fn depth(n: usize) -> Result<usize, ShapeError> {
    if DEPTH.contains(&n) {
        Ok(n)
    } else {
        Err(ShapeError::Depth)
    }
}

/// The length of a transfer's work requests: its chunk, except that READ chunks longer than
/// `max_read_wr` are posted as WRs of at most that (on rxe a 16 MiB READ WR runs at half the rate
/// of 1 MiB ones; many NICs prefer READs of a few MTUs to a few MiB). WRITEs keep their chunk.
pub fn wr_chunk(read: bool, chunk: u64, max_read_wr: u64) -> u64 {
    if read {
        chunk.min(max_read_wr.max(1))
    } else {
        chunk
    }
}

/// One message of the benchmark (its scratch region on the target is this long).
pub fn bench_size(n: u64) -> Result<u64, ShapeError> {
    if (1..=MAX_CHUNK).contains(&n) {
        Ok(n)
    } else {
        Err(ShapeError::Size)
    }
}

/// A request field where 0 means "the configured default": the default, or the checked value.
pub fn or_default<T: PartialEq + Default>(v: T, default: T, check: fn(T) -> Result<T, ShapeError>) -> Result<T, ShapeError> {
    if v == T::default() {
        Ok(default)
    } else {
        check(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_inclusive_and_zero_is_refused() {
        assert_eq!(chunk(1), Ok(1));
        assert_eq!(chunk(MAX_CHUNK), Ok(MAX_CHUNK));
        assert_eq!(chunk(0), Err(ShapeError::Chunk));
        assert_eq!(chunk(MAX_CHUNK + 1), Err(ShapeError::Chunk));
        assert_eq!(qps(64), Ok(64));
        assert_eq!(qps(65).unwrap_err().to_string(), "qps must be 1-64");
        assert_eq!(depth(0).unwrap_err().to_string(), "depth must be 1-4096");
        assert_eq!(or_default(0usize, 2, qps), Ok(2));
        assert_eq!(or_default(65usize, 2, qps), Err(ShapeError::Qps));
    }

    #[test]
    fn only_reads_are_split() {
        assert_eq!(wr_chunk(true, 16 << 20, 1 << 20), 1 << 20);
        assert_eq!(wr_chunk(true, 4096, 1 << 20), 4096);
        assert_eq!(wr_chunk(false, 16 << 20, 1 << 20), 16 << 20);
        assert_eq!(wr_chunk(true, 16 << 20, 0), 1, "never a zero-length chunk");
    }

    /// 16 QPs on 8 devices would offer 128 endpoints: refused naming both numbers and what
    /// fits; at the edge (64, or 63 with the fallback's one) accepted.
    #[test]
    fn a_connection_over_several_devices_fits_one_offer() {
        assert_eq!(connection_endpoints(2, 1, false), Ok(2));
        assert_eq!(connection_endpoints(8, 8, false), Ok(64));
        assert_eq!(connection_endpoints(21, 3, true), Ok(64));
        assert_eq!(connection_endpoints(64, 0, false), Ok(64), "no device count known: one");
        let e = connection_endpoints(16, 8, false).unwrap_err();
        assert_eq!(e, "16 QPs × 8 devices = 128 endpoints in one connection offer, and a peer accepts at most 64: use at most 8 QPs with 8 devices, or fewer devices");
        let e = connection_endpoints(8, 8, true).unwrap_err();
        assert!(e.contains("+ 1 for the tcp fallback = 65 endpoints") && e.contains("at most 7 QPs"), "{e}");
        assert!(connection_endpoints(usize::MAX, usize::MAX, true).is_err(), "no overflow");
    }
}
