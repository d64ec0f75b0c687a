//! Distinct random slots for the KV benchmark, in memory proportional to what is drawn.
//!
//! The benchmark scatters `n` blocks over a pool of `slots` places. A Fisher-Yates shuffle over
//! a vector of every slot costs 8 bytes per slot, which the caller chooses: a 16 GiB pool of
//! 1-byte blocks asked for a 128 GiB vector and aborted the agent. Only the first `n` steps of
//! the shuffle are needed, so the swaps are kept in a map instead (a slot not in it holds
//! itself): O(n) memory and time whatever the pool, and the same sequence as the full shuffle.
use std::collections::HashMap;

/// `min(n, slots)` distinct slots in `0..slots`, a seeded xorshift drawing them.
pub fn distinct_slots(slots: u64, n: u64, seed: u64) -> Vec<u64> {
    let n = n.min(slots);
    let mut swapped: HashMap<u64, u64> = HashMap::with_capacity(n.saturating_mul(2).min(1 << 20) as usize);
    let mut out = Vec::with_capacity(n.min(1 << 20) as usize);
    let mut x = seed | 1;
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let j = i + x % (slots - i);
        let at_j = swapped.get(&j).copied().unwrap_or(j);
        let at_i = swapped.get(&i).copied().unwrap_or(i);
        swapped.insert(j, at_i);
        out.push(at_j);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The full shuffle this replaces, for comparison on small pools.
    fn dense(slots: u64, n: u64, seed: u64) -> Vec<u64> {
        let mut v: Vec<u64> = (0..slots).collect();
        let mut x = seed | 1;
        for i in 0..n.min(slots) as usize {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let j = i + (x % (slots - i as u64)) as usize;
            v.swap(i, j);
        }
        v.truncate(n.min(slots) as usize);
        v
    }

    #[test]
    fn same_draw_as_the_full_shuffle() {
        for (slots, n) in [(1, 1), (10, 10), (100, 7), (4096, 1024), (5, 9)] {
            assert_eq!(distinct_slots(slots, n, 0x9E37_79B9), dense(slots, n, 0x9E37_79B9), "{slots} slots, {n} drawn");
        }
    }

    #[test]
    fn a_huge_pool_costs_only_what_is_drawn() {
        let v = distinct_slots(16 << 30, 65_536, 7);
        assert_eq!(v.len(), 65_536);
        let set: std::collections::HashSet<u64> = v.iter().copied().collect();
        assert_eq!(set.len(), v.len(), "distinct");
        assert!(v.iter().all(|&s| s < 16 << 30));
    }
}
