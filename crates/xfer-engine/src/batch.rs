//! A batch's segments, checked and coalesced before any byte moves (sans-IO, no allocation per
//! WR later). A submit names its segments in absolute offsets of the local and the remote
//! region; [`Batch::new`] refuses the list with an error that names the bad segment (by its
//! index in the request), then merges runs that are contiguous on both sides. The batch keeps
//! remote offsets relative to the lowest remote offset it touches ([`Batch::remote_base`]): that
//! is where the peer's grant starts, and the grant spans [`Batch::remote_span`].
use std::sync::Arc;

/// One piece of a batch, as asked: absolute offsets in the local and the remote region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSpec {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

/// One coalesced piece: `local` absolute in the local region, `remote` relative to
/// [`Batch::remote_base`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

/// Which side a transfer writes into (a WRITE writes the remote region, a READ the local one):
/// destination ranges of one batch must not overlap, or the bytes that land would depend on
/// the order the fabric happened to execute them in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    Local,
    Remote,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("empty segment list: nothing to copy")]
    Empty,
    #[error("{n} segments in one batch; this agent takes at most {max} (transfer.max_segments)")]
    TooMany { n: usize, max: usize },
    #[error("segment {i}: zero length")]
    ZeroLength { i: usize },
    #[error("segment {i}: offset {offset} + length {len} overflows")]
    Overflow { i: usize, offset: u64, len: u64 },
    #[error("segment {i}: local range {offset}+{len} is beyond the end of region {region:?} ({region_len} bytes)")]
    LocalRange { i: usize, offset: u64, len: u64, region: String, region_len: u64 },
    #[error("segments {a} and {b}: destination ranges overlap ({side} offsets {a_start}..{a_end} and {b_start}..{b_end})")]
    Overlap { a: usize, b: usize, side: &'static str, a_start: u64, a_end: u64, b_start: u64, b_end: u64 },
    #[error("segment {i}: remote range {offset}+{len} is outside the granted range {grant_offset}+{grant_len}")]
    PastGrant { i: usize, offset: u64, len: u64, grant_offset: u64, grant_len: u64 },
}

/// A checked, coalesced segment list.
#[derive(Debug, Clone)]
pub struct Batch {
    segs: Arc<[Seg]>,
    /// Segments as asked (before coalescing).
    asked: usize,
    bytes: u64,
    local_lo: u64,
    remote_base: u64,
    remote_span: u64,
}

impl Batch {
    /// Checks `specs` against the local region (`region`, `region_len`) and the limits, then
    /// coalesces. `dest` is the side the transfer writes into.
    pub fn new(specs: &[SegmentSpec], region: &str, region_len: u64, dest: Dest, max: usize) -> Result<Batch, BatchError> {
        if specs.is_empty() {
            return Err(BatchError::Empty);
        }
        if specs.len() > max {
            return Err(BatchError::TooMany { n: specs.len(), max });
        }
        let (mut local_lo, mut remote_lo, mut remote_hi, mut bytes) = (u64::MAX, u64::MAX, 0u64, 0u64);
        for (i, s) in specs.iter().enumerate() {
            if s.len == 0 {
                return Err(BatchError::ZeroLength { i });
            }
            let local_end = s.local.checked_add(s.len).ok_or(BatchError::Overflow { i, offset: s.local, len: s.len })?;
            let remote_end = s.remote.checked_add(s.len).ok_or(BatchError::Overflow { i, offset: s.remote, len: s.len })?;
            if local_end > region_len {
                return Err(BatchError::LocalRange { i, offset: s.local, len: s.len, region: region.to_string(), region_len });
            }
            local_lo = local_lo.min(s.local);
            remote_lo = remote_lo.min(s.remote);
            remote_hi = remote_hi.max(remote_end);
            // Sources may overlap (one block sent to many places), so the sum may exceed the
            // region: saturate rather than overflow.
            bytes = bytes.saturating_add(s.len);
        }
        check_overlap(specs, dest)?;
        let mut segs: Vec<Seg> = Vec::with_capacity(specs.len());
        for s in specs {
            let seg = Seg { local: s.local, remote: s.remote - remote_lo, len: s.len };
            match segs.last_mut() {
                Some(last) if last.local + last.len == seg.local && last.remote + last.len == seg.remote => last.len += seg.len,
                _ => segs.push(seg),
            }
        }
        Ok(Batch { segs: segs.into(), asked: specs.len(), bytes, local_lo, remote_base: remote_lo, remote_span: remote_hi - remote_lo })
    }

    /// One range: `len` bytes from `local` to the grant's start (a transfer without segments).
    pub fn single(local: u64, remote: u64, len: u64) -> Batch {
        Batch {
            segs: Arc::from([Seg { local, remote: 0, len }]),
            asked: 1,
            bytes: len,
            local_lo: local,
            remote_base: remote,
            remote_span: len,
        }
    }

    pub fn segs(&self) -> &Arc<[Seg]> {
        &self.segs
    }

    /// Segments after coalescing.
    pub fn len(&self) -> usize {
        self.segs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.segs.is_empty()
    }

    /// Segments as asked.
    pub fn asked(&self) -> usize {
        self.asked
    }

    /// Total bytes moved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The lowest local offset the batch touches.
    pub fn local_lo(&self) -> u64 {
        self.local_lo
    }

    /// The lowest remote offset the batch touches: the grant's start.
    pub fn remote_base(&self) -> u64 {
        self.remote_base
    }

    /// Bytes from [`Batch::remote_base`] to the end of the highest remote segment: the grant's length.
    pub fn remote_span(&self) -> u64 {
        self.remote_span
    }

    /// Checks that every segment lies inside a grant of `grant_len` bytes at `grant_offset`
    /// (absolute in the remote region); names the first one that does not (by its coalesced index).
    pub fn check_grant(&self, grant_offset: u64, grant_len: u64) -> Result<(), BatchError> {
        let grant_end = grant_offset.saturating_add(grant_len);
        for (i, s) in self.segs.iter().enumerate() {
            let offset = self.remote_base.saturating_add(s.remote);
            if offset < grant_offset || offset.saturating_add(s.len) > grant_end {
                return Err(BatchError::PastGrant { i, offset, len: s.len, grant_offset, grant_len });
            }
        }
        Ok(())
    }
}

/// Refuses two segments whose destination ranges overlap, naming both (request indices).
fn check_overlap(specs: &[SegmentSpec], dest: Dest) -> Result<(), BatchError> {
    let start = |s: &SegmentSpec| match dest {
        Dest::Local => s.local,
        Dest::Remote => s.remote,
    };
    let mut order: Vec<u32> = (0..specs.len() as u32).collect();
    order.sort_unstable_by_key(|&i| start(&specs[i as usize]));
    // The segment (of those seen) that reaches furthest: any later start below its end overlaps it.
    let mut reach: Option<(usize, u64, u64)> = None;
    for &i in &order {
        let i = i as usize;
        let (s, e) = (start(&specs[i]), start(&specs[i]) + specs[i].len);
        if let Some((a, a_start, a_end)) = reach {
            if s < a_end {
                let (x, y) = ((a, a_start, a_end), (i, s, e));
                let (lo, hi) = if x.0 < y.0 { (x, y) } else { (y, x) };
                let side = if dest == Dest::Local { "local" } else { "remote" };
                return Err(BatchError::Overlap { a: lo.0, b: hi.0, side, a_start: lo.1, a_end: lo.2, b_start: hi.1, b_end: hi.2 });
            }
        }
        if reach.is_none_or(|(_, _, end)| e > end) {
            reach = Some((i, s, e));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(local: u64, remote: u64, len: u64) -> SegmentSpec {
        SegmentSpec { local, remote, len }
    }

    #[test]
    fn contiguous_runs_coalesce_and_others_do_not() {
        let b = Batch::new(
            &[spec(0, 100, 10), spec(10, 110, 10), spec(20, 200, 5), spec(40, 205, 5), spec(45, 210, 5)],
            "r",
            1000,
            Dest::Remote,
            16,
        )
        .unwrap();
        assert_eq!(
            &b.segs()[..],
            &[Seg { local: 0, remote: 0, len: 20 }, Seg { local: 20, remote: 100, len: 5 }, Seg { local: 40, remote: 105, len: 10 }]
        );
        assert_eq!((b.asked(), b.bytes(), b.local_lo(), b.remote_base(), b.remote_span()), (5, 35, 0, 100, 115));
    }

    #[test]
    fn every_bad_list_names_its_segment() {
        let b = |s: &[SegmentSpec]| Batch::new(s, "pool", 100, Dest::Remote, 3);
        assert_eq!(b(&[]).unwrap_err(), BatchError::Empty);
        assert_eq!(b(&[spec(0, 0, 1); 4]).unwrap_err(), BatchError::TooMany { n: 4, max: 3 });
        assert_eq!(b(&[spec(0, 0, 1), spec(1, 1, 0)]).unwrap_err(), BatchError::ZeroLength { i: 1 });
        assert!(matches!(b(&[spec(0, u64::MAX, 2)]).unwrap_err(), BatchError::Overflow { i: 0, .. }));
        let e = b(&[spec(0, 0, 1), spec(99, 5, 2)]).unwrap_err();
        assert!(matches!(e, BatchError::LocalRange { i: 1, offset: 99, len: 2, region_len: 100, .. }), "{e}");
        assert!(e.to_string().contains("segment 1") && e.to_string().contains("\"pool\""), "{e}");
        let e = b(&[spec(0, 50, 10), spec(10, 0, 10), spec(20, 55, 1)]).unwrap_err();
        assert!(matches!(e, BatchError::Overlap { a: 0, b: 2, side: "remote", .. }), "{e}");
    }

    #[test]
    fn overlap_is_checked_on_the_destination_side_only() {
        // Same source twice (a broadcast of one block) is fine for a WRITE...
        assert!(Batch::new(&[spec(0, 0, 10), spec(0, 10, 10)], "r", 100, Dest::Remote, 8).is_ok());
        // ...but not for a READ, whose destination is local.
        let e = Batch::new(&[spec(0, 0, 10), spec(0, 10, 10)], "r", 100, Dest::Local, 8).unwrap_err();
        assert!(matches!(e, BatchError::Overlap { a: 0, b: 1, side: "local", .. }), "{e}");
        // Touching is not overlapping; a long segment overlapping a later short one is found.
        assert!(Batch::new(&[spec(0, 0, 10), spec(10, 10, 10)], "r", 100, Dest::Remote, 8).is_ok());
        let e = Batch::new(&[spec(0, 0, 50), spec(60, 10, 1), spec(70, 40, 1)], "r", 100, Dest::Remote, 8).unwrap_err();
        assert!(matches!(e, BatchError::Overlap { a: 0, b: 1, .. }), "{e}");
    }

    /// Against a brute-force check over random small lists: the verdict agrees, and an accepted
    /// batch moves exactly the asked bytes to the asked places.
    #[test]
    fn overlap_and_coalescing_agree_with_brute_force() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..2000 {
            let n = 1 + next(6) as usize;
            let specs: Vec<SegmentSpec> = (0..n).map(|_| spec(next(40), next(40), 1 + next(8))).collect();
            let overlaps = (0..n).any(|i| {
                (0..i).any(|j| specs[i].remote < specs[j].remote + specs[j].len && specs[j].remote < specs[i].remote + specs[i].len)
            });
            match Batch::new(&specs, "r", 64, Dest::Remote, 8) {
                Ok(b) => {
                    assert!(!overlaps, "{specs:?}");
                    let mut want: Vec<(u64, u64)> =
                        specs.iter().flat_map(|s| (0..s.len).map(move |k| (s.remote + k, s.local + k))).collect();
                    let base = b.remote_base();
                    let mut got: Vec<(u64, u64)> =
                        b.segs().iter().flat_map(|s| (0..s.len).map(move |k| (base + s.remote + k, s.local + k))).collect();
                    want.sort_unstable();
                    got.sort_unstable();
                    assert_eq!(got, want, "{specs:?}");
                    assert!(b.check_grant(b.remote_base(), b.remote_span()).is_ok());
                }
                Err(BatchError::Overlap { a, b, .. }) => {
                    assert!(overlaps && a < b, "{specs:?}");
                    let (p, q) = (specs[a], specs[b]);
                    assert!(p.remote < q.remote + q.len && q.remote < p.remote + p.len, "named a pair that does not overlap: {specs:?}");
                }
                Err(e) => panic!("{e} for {specs:?}"),
            }
        }
    }

    #[test]
    fn a_segment_past_the_grant_is_named() {
        let b = Batch::new(&[spec(0, 100, 10), spec(10, 120, 10)], "r", 100, Dest::Remote, 8).unwrap();
        assert!(b.check_grant(100, 30).is_ok());
        assert_eq!(
            b.check_grant(100, 25).unwrap_err(),
            BatchError::PastGrant { i: 1, offset: 120, len: 10, grant_offset: 100, grant_len: 25 }
        );
        assert!(matches!(b.check_grant(105, 100).unwrap_err(), BatchError::PastGrant { i: 0, .. }));
    }
}
