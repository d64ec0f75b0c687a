//! Gathered writes: many frames (headers the caller owns, payloads straight from region memory)
//! in one vectored write, so a run of small or medium messages costs one system call and one
//! push of segments instead of one per message, and no payload is copied in user space.
//!
//! The same contract as [`crate::memory`]'s zero-copy socket operations: a slice over region
//! memory exists only inside one `poll_write_vectored` call, and memory that can shrink should
//! be sent from a copy (a [`Piece::Bytes`]).
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;

use crate::memory::RegionMemory;

/// Most slices one write passes to the kernel (Linux's `IOV_MAX`; `writev` refuses more).
pub const MAX_SLICES: usize = 1024;

/// One piece of a gathered write.
#[derive(Clone, Copy, Debug)]
pub enum Piece<'a> {
    /// Bytes the caller owns: frame headers, payloads copied out of memory that can shrink.
    Bytes(&'a [u8]),
    /// `offset..offset + len` of a region's mapping, sent without a copy.
    Region(&'a RegionMemory, u64, usize),
}

impl Piece<'_> {
    pub fn len(&self) -> usize {
        match *self {
            Piece::Bytes(b) => b.len(),
            Piece::Region(_, _, len) => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One `poll_write_vectored` of `pieces`, starting `from` bytes into them (counted across all
/// pieces: what earlier calls already wrote), with at most [`MAX_SLICES`] slices. Returns how
/// many bytes `w` took. A region piece outside its mapping fails the call before anything is
/// written; `Ok(0)` only when nothing is left to write (or `w` took nothing).
pub fn poll_write_gathered<W: AsyncWrite + ?Sized>(
    w: Pin<&mut W>,
    cx: &mut Context<'_>,
    pieces: &[Piece<'_>],
    from: usize,
) -> Poll<io::Result<usize>> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(pieces.len().min(MAX_SLICES));
    let mut skip = from;
    for piece in pieces {
        if slices.len() == MAX_SLICES {
            break;
        }
        let len = piece.len();
        if skip >= len {
            skip -= len;
            continue;
        }
        let bytes: &[u8] = match *piece {
            Piece::Bytes(b) => &b[skip..],
            Piece::Region(mem, offset, len) => {
                // SAFETY: the slice is handed to the one `poll_write_vectored` below and dropped
                // with `slices` when this function returns (`transient_slice`'s contract);
                // concurrent writers may tear the bytes being sent, exactly as an RDMA READ
                // racing a WRITE would (the memory module's contract).
                match unsafe { mem.transient_slice(offset, len) } {
                    Ok(whole) => &whole[skip..],
                    Err(e) => return Poll::Ready(Err(io::Error::other(e))),
                }
            }
        };
        skip = 0;
        if !bytes.is_empty() {
            slices.push(IoSlice::new(bytes));
        }
    }
    if slices.is_empty() {
        return Poll::Ready(Ok(0));
    }
    w.poll_write_vectored(cx, &slices)
}

/// Writes all of `pieces` (see [`poll_write_gathered`]); `WriteZero` if `w` stops taking bytes.
pub async fn write_all_gathered<W: AsyncWrite + Unpin + ?Sized>(w: &mut W, pieces: &[Piece<'_>]) -> io::Result<()> {
    let total: usize = pieces.iter().map(Piece::len).sum();
    let mut done = 0usize;
    while done < total {
        let n = std::future::poll_fn(|cx| poll_write_gathered(Pin::new(&mut *w), cx, pieces, done)).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;

    /// Headers, region ranges and owned bytes, written through a pipe that takes a few bytes at
    /// a time (every call resumes inside a piece), arrive whole and in order; more pieces than
    /// one call may pass still all arrive.
    #[tokio::test]
    async fn pieces_arrive_whole_and_in_order_through_partial_writes() {
        let mem = RegionMemory::anonymous(1 << 16, false).expect("mapping");
        let pattern: Vec<u8> = (0..(1usize << 16)).map(|k| (k * 13 + 1) as u8).collect();
        mem.write_at(0, &pattern).expect("fill");
        let heads: Vec<[u8; 5]> = (0..1500u32).map(|i| [i as u8, (i >> 8) as u8, 0xaa, 0xbb, 0xcc]).collect();
        let mut pieces = Vec::new();
        let mut expected = Vec::new();
        for (i, h) in heads.iter().enumerate() {
            pieces.push(Piece::Bytes(h));
            expected.extend_from_slice(h);
            let (off, len) = ((i * 37) % 60_000, i % 97);
            pieces.push(Piece::Region(&mem, off as u64, len));
            expected.extend_from_slice(&pattern[off..off + len]);
        }
        assert!(pieces.len() > MAX_SLICES);
        let (mut ours, mut theirs) = tokio::io::duplex(333);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).await.expect("read");
            got
        });
        write_all_gathered(&mut ours, &pieces).await.expect("write");
        drop(ours);
        assert_eq!(reader.await.expect("reader"), expected);
    }

    /// A region piece past the end of its mapping fails the write before any byte leaves.
    #[tokio::test]
    async fn a_piece_outside_its_mapping_writes_nothing() {
        let mem = RegionMemory::anonymous(4096, false).expect("mapping");
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
        let pieces = [Piece::Bytes(b"head"), Piece::Region(&mem, 4000, 200)];
        let err = write_all_gathered(&mut ours, &pieces).await.expect_err("out of range");
        assert_eq!(err.kind(), io::ErrorKind::Other);
        drop(ours);
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).await.expect("read");
        assert!(got.is_empty(), "{} bytes left before the refusal", got.len());
    }
}
