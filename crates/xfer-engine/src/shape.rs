//! The bounds of a transfer's shape — chunk size, QPs per connection, window depth — in one place,
//! used by configuration validation, `SubmitTransfer`, `Agent.Connect` and the benchmark, so the
//! numbers and their messages cannot drift apart.
use std::ops::RangeInclusive;

/// Largest chunk (one work request). The tcp fabric's frame payload bound; verbs uses the same
/// ceiling so a transfer's shape is valid on either fabric.
pub const MAX_CHUNK: u64 = crate::frame::MAX_PAYLOAD as u64;
/// QPs (tcp: data streams) per connection a transfer may ask for.
pub const QPS: RangeInclusive<usize> = 1..=64;
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
}
