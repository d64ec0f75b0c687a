//! End-to-end checksums of region ranges (xxh3-64 or crc32c), computed over copies of region
//! memory taken in bounded pieces: region memory is never borrowed as a slice outside
//! `xfer_rdma::memory` (the NIC, peers and other processes may change it meanwhile).
use xfer_rdma::memory::{MemError, RegionMemory};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algo {
    Xxh3,
    Crc32c,
}

/// Bytes copied out per piece: small enough to stay in cache between the copy and the hash.
const PIECE: u64 = 256 << 10;

/// `MemError::Poisoned` if the region's file shrank under its mapping (checked after hashing, so
/// a sum over zeros standing in for missing pages is never returned).
pub fn checksum(mem: &RegionMemory, offset: u64, len: u64, algo: Algo) -> Result<u64, MemError> {
    checksum_ranges(mem, &[(offset, len)], algo)
}

/// The checksum of `ranges` (offset, length) read one after the other, as if they were one
/// buffer: a batch's scattered segments, taken in the batch's order on each side, sum alike
/// when every segment landed. One range sums as [`checksum`] of it.
pub fn checksum_ranges(mem: &RegionMemory, ranges: &[(u64, u64)], algo: Algo) -> Result<u64, MemError> {
    mem.intact()?;
    for &(offset, len) in ranges {
        mem.check(offset, len)?;
    }
    let longest = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    let mut buf = vec![0u8; longest.min(PIECE) as usize];
    let mut each = |f: &mut dyn FnMut(&[u8])| -> Result<(), MemError> {
        for &(offset, len) in ranges {
            let (mut pos, end) = (offset, offset + len);
            while pos < end {
                let n = (end - pos).min(PIECE) as usize;
                mem.read_at(pos, &mut buf[..n])?;
                f(&buf[..n]);
                pos += n as u64;
            }
        }
        Ok(())
    };
    match algo {
        Algo::Xxh3 => {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            each(&mut |b| h.update(b))?;
            mem.intact()?;
            Ok(h.digest())
        }
        Algo::Crc32c => {
            let mut c = 0u32;
            each(&mut |b| c = crc32c::crc32c_append(c, b))?;
            mem.intact()?;
            Ok(c as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn piecewise_equals_one_shot() {
        let m = RegionMemory::anonymous(9 << 20, false).unwrap();
        let data: Vec<u8> = (0..(9u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        m.write_at(0, &data).unwrap();
        assert_eq!(checksum(&m, 1, (9 << 20) - 1, Algo::Xxh3).unwrap(), xxhash_rust::xxh3::xxh3_64(&data[1..]));
        assert_eq!(checksum(&m, 0, 9 << 20, Algo::Crc32c).unwrap(), crc32c::crc32c(&data) as u64);
        assert!(checksum(&m, 1, 9 << 20, Algo::Xxh3).is_err());
    }

    #[test]
    fn ranges_sum_as_their_concatenation_in_order() {
        let m = RegionMemory::anonymous(1 << 20, false).unwrap();
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        m.write_at(0, &data).unwrap();
        let ranges = [(700_000u64, 300_000u64), (5, 10), (0, 5)];
        let cat: Vec<u8> = ranges.iter().flat_map(|&(o, l)| data[o as usize..(o + l) as usize].to_vec()).collect();
        assert_eq!(checksum_ranges(&m, &ranges, Algo::Xxh3).unwrap(), xxhash_rust::xxh3::xxh3_64(&cat));
        assert_eq!(checksum_ranges(&m, &ranges, Algo::Crc32c).unwrap(), crc32c::crc32c(&cat) as u64);
        // Order matters: the same segments in another order are another batch.
        assert_ne!(
            checksum_ranges(&m, &[(0, 5), (5, 10)], Algo::Xxh3).unwrap(),
            checksum_ranges(&m, &[(5, 10), (0, 5)], Algo::Xxh3).unwrap()
        );
        // One range out of bounds refuses the whole sum.
        assert!(checksum_ranges(&m, &[(0, 5), (1 << 20, 1)], Algo::Xxh3).is_err());
    }
}
