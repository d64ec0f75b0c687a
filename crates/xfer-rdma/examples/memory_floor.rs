//! What this host's memory costs a KV batch, with no network at all: `BLOCKS` blocks of `BLOCK`
//! bytes at random places in a `POOL`-byte region, filled so every page exists, moved the way a
//! tcp transport must move them:
//!
//! * **read**: each block copied out of the pool into a small buffer the caches hold, as the
//!   sender's kernel copies a WRITE's payload from region memory into socket buffers;
//! * **land**: a cached buffer copied into each block with [`RegionMemory::land`] (streaming
//!   stores in a large region), as the tcp fabric's target lands a payload;
//! * **hot**: the same bytes copied between two cached buffers, what a raw TCP stream between
//!   two small hot buffers pays for its copies instead.
//!
//! Each is timed `ROUNDS` times over fresh random places; the median per batch is printed as
//! JSON (`scripts/bench-tcp` prints it beside the KV rows). A raw TCP baseline that moves one hot
//! buffer never pays `read` or `land`; a transport moving a real batch pays both, on the two
//! ends. Usage: `memory_floor BLOCK BLOCKS POOL [ROUNDS]` (sizes in bytes).
mod common;

use std::time::Instant;

use common::{median, next};
use xfer_rdma::memory::RegionMemory;

/// The cached buffer a block is copied out of or into (as large as the tcp target's read buffer).
const HOT: usize = 64 << 10;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<u64> = std::env::args().skip(1).map(|a| a.parse::<u64>()).collect::<Result<_, _>>()?;
    let (block, blocks, pool, rounds) = match args[..] {
        [b, n, p] => (b, n, p, 5),
        [b, n, p, r] => (b, n, p, r),
        _ => return Err("usage: memory_floor BLOCK BLOCKS POOL [ROUNDS]".into()),
    };
    if block == 0 || block as usize > HOT || blocks == 0 || rounds == 0 || pool / block < blocks {
        return Err(format!("need 0 < BLOCK <= {HOT}, BLOCKS > 0, ROUNDS > 0 and BLOCKS blocks in POOL").into());
    }
    let mem = RegionMemory::anonymous(usize::try_from(pool)?, false)?;
    // Every page written before any clock, as the agent fills a benchmark's pool.
    mem.fill(0xa5)?;
    // The cached buffer starts on a page, as the pool's blocks do: the copies' relative
    // alignment then does not differ from run to run (see below).
    let mut hot_store = vec![0x5au8; HOT + 4096];
    let skip = (4096 - hot_store.as_ptr() as usize % 4096) % 4096;
    let hot = &mut hot_store[skip..skip + HOT];
    // The hot copy's two buffers are halves of one allocation, a multiple of 4 KiB apart: a
    // copy whose destination lies 1 to 31 bytes past its source modulo 4 KiB runs about twenty
    // times slower on this project's AMD host (`rep movsb`), which two separate allocations
    // can hit by chance. A raw TCP stream's copies are not slowed so.
    let mut pair = vec![0x3cu8; 2 * HOT];
    let slots = pool / block;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let (mut read, mut land, mut copy) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let places: Vec<u64> = (0..blocks).map(|_| next(&mut seed) % slots * block).collect();
        let b = block as usize;
        let t = Instant::now();
        for (i, &p) in places.iter().enumerate() {
            let at = i * b % (HOT - HOT % b);
            mem.read_at(p, &mut hot[at..at + b])?;
        }
        read.push(t.elapsed().as_secs_f64());
        let places: Vec<u64> = (0..blocks).map(|_| next(&mut seed) % slots * block).collect();
        let t = Instant::now();
        for (i, &p) in places.iter().enumerate() {
            let at = i * b % (HOT - HOT % b);
            mem.land(p, &hot[at..at + b])?;
        }
        land.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let (src, dst) = pair.split_at_mut(HOT);
        for i in 0..blocks as usize {
            let at = i * b % (HOT - HOT % b);
            dst[at..at + b].copy_from_slice(&src[at..at + b]);
        }
        copy.push(t.elapsed().as_secs_f64());
        // Keep the copies' results observable, so none is optimised away.
        std::hint::black_box((&*hot, &pair));
    }
    let gib = (block * blocks) as f64 / f64::from(1u32 << 30);
    let (read, land, copy) = (median(read), median(land), median(copy));
    println!(
        "{{\"block\":{block},\"blocks\":{blocks},\"pool\":{pool},\"rounds\":{rounds},\
         \"read_ms\":{:.3},\"land_ms\":{:.3},\"hot_ms\":{:.3},\
         \"read_gib_per_s\":{:.3},\"land_gib_per_s\":{:.3},\"hot_gib_per_s\":{:.3}}}",
        read * 1e3,
        land * 1e3,
        copy * 1e3,
        gib / read,
        gib / land,
        gib / copy
    );
    Ok(())
}
