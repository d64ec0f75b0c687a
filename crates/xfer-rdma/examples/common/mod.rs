//! What the `memory_floor` and `loopback_floor` examples share: their random places and medians.

/// xorshift64*: random places without a dependency (nothing here needs more than spread).
pub fn next(s: &mut u64) -> u64 {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    s.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// The middle of `v`'s figures (the upper middle for an even count); `v` is not empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
