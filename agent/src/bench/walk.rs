//! The scattered walk of the raw TCP baseline (`--baseline tcp-scatter`): both ends move their
//! share of a pool in pieces of the KV block size at random places, the sender in gathered writes
//! and the sink in gathered reads of at most [`GATHER_PIECES`] pieces or [`GATHER_BYTES`], as the
//! tcp fabric's writer gathers. It is the KV pattern's memory traffic (every block leaves from
//! and lands in lines no cache holds, each in another page) moved by raw TCP with no protocol:
//! the fabric's KV rows against it measure what the protocol costs, apart from the memory.
use std::io::{self, IoSlice, IoSliceMut};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::sample::distinct_slots;
use crate::error::NodeError;
use crate::peer_api::Walk;

/// Most pieces one gathered call moves (the fabric's writer: 512 frames).
const GATHER_PIECES: usize = 512;
/// Bytes past which a gathered call takes no further piece (the fabric's writer: 2 MiB).
const GATHER_BYTES: usize = 2 << 20;
/// The smallest piece: below a few hundred bytes the walk measures system calls, not memory.
const MIN_PIECE: u64 = 512;
/// Seeds of the two ends' shuffles (any two values; fixed so runs compare).
const SEND_SEED: u64 = 0x2545_F491_4F6C_DD1D;
const SINK_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// Checks `walk` for `n` streams, with `tls` or not, before anything is allocated: a scattered
/// walk needs a pool, plaintext, and a piece of [`MIN_PIECE`] bytes or more that fits a stream's
/// share at least once.
pub(super) fn check(walk: Walk, n: u32, tls: bool) -> Result<(), NodeError> {
    if walk.scatter == 0 {
        return Ok(());
    }
    if tls {
        return Err(NodeError::Invalid("a scattered baseline is plaintext (its gathered reads need the socket)".into()));
    }
    let share = walk.pool / u64::from(n.max(1));
    if walk.scatter < MIN_PIECE || walk.scatter > share {
        return Err(NodeError::Invalid(format!(
            "scatter pieces of {} bytes: at least {MIN_PIECE} and at most a stream's share of the pool ({share} bytes)",
            walk.scatter
        )));
    }
    Ok(())
}

/// The share's pieces in a shuffled order (distinct: a gathered read may hold a window of them
/// mutably at once).
fn order(share: usize, piece: usize, seed: u64) -> Vec<usize> {
    let slots = (share / piece) as u64;
    distinct_slots(slots, slots, seed).into_iter().map(|s| s as usize * piece).collect()
}

/// Sends `per` bytes from `buf` in pieces of `piece` bytes at the places of a shuffle of `buf`'s
/// pieces (walked again and again), in gathered writes; then waits for the sink to close.
pub(super) async fn send(mut s: TcpStream, per: u64, buf: &[u8], piece: usize) -> io::Result<u64> {
    let order = order(buf.len(), piece, SEND_SEED);
    let (mut left, mut next) = (per, 0usize);
    while left > 0 {
        let mut iov = Vec::with_capacity(GATHER_PIECES);
        let mut bytes = 0usize;
        while iov.len() < GATHER_PIECES && bytes < GATHER_BYTES && (bytes as u64) < left {
            let k = piece.min((left - bytes as u64) as usize);
            let at = order[next % order.len()];
            next += 1;
            iov.push(IoSlice::new(&buf[at..at + k]));
            bytes += k;
        }
        let mut rest = &mut iov[..];
        while !rest.is_empty() {
            let n = s.write_vectored(rest).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
        left -= bytes as u64;
    }
    s.shutdown().await?;
    let mut one = [0u8; 1];
    let _ = s.read(&mut one).await;
    Ok(per)
}

/// Reads `s` to its end into `buf` in pieces of `piece` bytes at the places of a shuffle of its
/// pieces (walked again and again), in gathered reads. Returns the stream and the buffer.
pub(super) async fn drain<B: AsMut<[u8]>>(s: TcpStream, mut memory: B, piece: usize) -> Option<(TcpStream, B)> {
    let buf = memory.as_mut();
    let order = order(buf.len(), piece, SINK_SEED);
    // The next piece to fill (an index into `order`) and how much of it is filled already.
    let (mut next, mut partial) = (0usize, 0usize);
    loop {
        if s.readable().await.is_err() {
            return None;
        }
        // A window of the next distinct pieces, each as a slice of `buf` (at most one per piece:
        // a window never wraps onto a piece twice), in the order the bytes arrive.
        let count = GATHER_PIECES.min(order.len()).min(GATHER_BYTES / piece).max(1);
        let mut wanted: Vec<(usize, usize)> = (0..count).map(|k| (order[(next + k) % order.len()], k)).collect();
        wanted.sort_unstable();
        let mut parts: Vec<(usize, &mut [u8])> = Vec::with_capacity(count);
        let (mut rest, mut base): (&mut [u8], usize) = (&mut *buf, 0);
        for (at, k) in wanted {
            let from = at + if k == 0 { partial } else { 0 };
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut(from - base);
            let (mine, tail) = tail.split_at_mut(at + piece - from);
            parts.push((k, mine));
            (rest, base) = (tail, at + piece);
        }
        parts.sort_unstable_by_key(|(k, _)| *k);
        let mut iov: Vec<IoSliceMut<'_>> = parts.into_iter().map(|(_, m)| IoSliceMut::new(m)).collect();
        match s.try_read_vectored(&mut iov) {
            Ok(0) => break,
            Ok(n) => {
                let filled = partial + n;
                (next, partial) = ((next + filled / piece) % order.len(), filled % piece);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return None,
        }
    }
    Some((s, memory))
}

#[cfg(test)]
mod tests {
    use super::{check, drain, order, send, MIN_PIECE, SEND_SEED, SINK_SEED};
    use crate::error::NodeError;
    use crate::peer_api::Walk;

    #[test]
    fn a_scattered_walk_needs_a_pool_plaintext_and_a_piece_that_fits_a_share() {
        assert!(check(Walk { pool: 0, scatter: 0 }, 2, true).is_ok(), "no scatter, nothing to check");
        assert!(check(Walk { pool: 1 << 20, scatter: 4096 }, 2, false).is_ok());
        assert!(check(Walk { pool: 1 << 20, scatter: 1 << 19 }, 2, false).is_ok(), "a share of one piece");
        for (walk, n, tls) in [
            (Walk { pool: 1 << 20, scatter: 4096 }, 2, true),
            (Walk { pool: 0, scatter: 4096 }, 1, false),
            (Walk { pool: 1 << 20, scatter: (1 << 19) + 1 }, 2, false),
            (Walk { pool: 1 << 20, scatter: MIN_PIECE - 1 }, 1, false),
            (Walk { pool: 1 << 20, scatter: u64::MAX }, 1, false),
            (Walk { pool: 1 << 20, scatter: 4096 }, 0, true),
        ] {
            assert!(matches!(check(walk, n, tls), Err(NodeError::Invalid(_))), "{walk:?} over {n} streams, tls {tls}");
        }
    }

    #[test]
    fn the_shuffle_visits_every_piece_of_the_share_once() {
        let mut o = order(10 * 4096 + 100, 4096, 7);
        assert_eq!(o.len(), 10);
        o.sort_unstable();
        assert_eq!(o, (0..10).map(|i| i * 4096).collect::<Vec<_>>());
    }

    /// One pass over a share: the k-th piece the sender took (its shuffle) lands at the k-th place
    /// of the sink's shuffle, whole, however the socket splits the bytes between gathered reads.
    #[tokio::test]
    async fn every_piece_arrives_whole_at_its_place_in_the_sinks_shuffle() {
        let (piece, pieces) = (4096usize, 1200usize);
        let share = piece * pieces;
        let src: Vec<u8> = (0..share).map(|i| ((i / piece) as u8) ^ (i as u8).rotate_left(3)).collect();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let sink = tokio::spawn(async move {
            let (s, _) = listener.accept().await.expect("accept");
            drain(s, vec![0u8; share], piece).await
        });
        let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let sender = {
            let src = src.clone();
            tokio::spawn(async move { send(s, share as u64, &src, piece).await })
        };
        let (s, got) = sink.await.expect("sink task").expect("drained to the end");
        drop(s);
        assert_eq!(sender.await.expect("sender task").expect("sent"), share as u64);
        let (from, to) = (order(share, piece, SEND_SEED), order(share, piece, SINK_SEED));
        for k in 0..pieces {
            assert_eq!(&got[to[k]..to[k] + piece], &src[from[k]..from[k] + piece], "piece {k}");
        }
    }
}
