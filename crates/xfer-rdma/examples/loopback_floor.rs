//! The most a transport could get out of this host's loopback TCP for a KV batch: `BLOCKS`
//! blocks of `BLOCK` bytes moved from random places of one `POOL`-byte mapping to random places
//! of another, over `CONNS` loopback connections, by plain threads on blocking sockets with no
//! protocol at all: every sender gathers up to [`GATHER`] blocks per `writev`, every receiver
//! reads them straight to their places with `readv` (it knows the layout in advance, which no
//! transport's target does). Beside it, in the same rounds, the hot raw TCP the KV rows of
//! `make bench` compare against: the same bytes written 1 MiB at a time from one cached buffer
//! per stream and read into another.
//!
//! The mappings are anonymous memory asking for transparent huge pages, as an anonymous region
//! is. Rounds alternate hot and scattered; each scattered round takes fresh random places. The
//! medians and the median ratio (hot time over scattered time: what the KV target's ratio can
//! reach at best) print as JSON, which `scripts/bench-tcp` shows beside the KV rows. Usage:
//! `loopback_floor BLOCK BLOCKS POOL [CONNS [ROUNDS]]` (sizes in bytes).
mod common;

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use common::{median, next};
use memmap2::MmapMut;

/// Most blocks one `writev` or `readv` takes (the tcp fabric's writer gathers up to 512 frames).
const GATHER: usize = 64;
/// The hot streams' write and read size.
const HOT: usize = 1 << 20;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse::<usize>()).collect::<Result<_, _>>()?;
    let (block, blocks, pool, conns, rounds) = match args[..] {
        [b, n, p] => (b, n, p, 2, 9),
        [b, n, p, c] => (b, n, p, c, 9),
        [b, n, p, c, r] => (b, n, p, c, r),
        _ => return Err("usage: loopback_floor BLOCK BLOCKS POOL [CONNS [ROUNDS]]".into()),
    };
    if block == 0 || blocks == 0 || conns == 0 || conns > 64 || rounds == 0 || pool / block < blocks {
        return Err("need BLOCK > 0, BLOCKS > 0, 0 < CONNS <= 64, ROUNDS > 0 and BLOCKS blocks in POOL".into());
    }
    let (src, mut dst) = (mapping(pool, 0xa5)?, mapping(pool, 0x5a)?);
    let mut hot: Vec<MmapMut> = (0..2 * conns).map(|_| mapping(HOT, 0x3c)).collect::<io::Result<_>>()?;
    let pairs = connect(conns)?;
    let slots = pool / block;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let (mut hot_t, mut scatter_t, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let total = block * blocks;
        std::thread::scope(|s| -> io::Result<()> {
            let mut work = Vec::new();
            let (tx, rx) = hot.split_at_mut(conns);
            for ((pair, out), into) in pairs.iter().zip(tx.iter()).zip(rx.iter_mut()) {
                let share = total / conns;
                work.push(s.spawn(move || stream_hot(&pair.0, out, share)));
                work.push(s.spawn(move || drain_hot(&pair.1, into, share)));
            }
            work.into_iter().try_for_each(|w| w.join().unwrap_or_else(|_| Err(io::Error::other("a thread panicked"))))
        })?;
        let hot_s = t.elapsed().as_secs_f64();
        // Fresh random places on both sides; the destinations as disjoint slices of the mapping.
        let from = distinct(slots, blocks, &mut seed);
        let to = distinct(slots, blocks, &mut seed);
        let sources: Vec<&[u8]> = src.chunks_exact(block).collect();
        let mut places: Vec<Option<&mut [u8]>> = dst.chunks_exact_mut(block).map(Some).collect();
        let mut outs: Vec<Vec<&[u8]>> = vec![Vec::new(); conns];
        let mut ins: Vec<Vec<&mut [u8]>> = (0..conns).map(|_| Vec::new()).collect();
        for (i, (&f, &d)) in from.iter().zip(&to).enumerate() {
            outs[i % conns].push(sources[f]);
            // `distinct` never repeats a slot, so each place is taken once.
            ins[i % conns].push(places[d].take().ok_or("a destination taken twice")?);
        }
        let t = Instant::now();
        std::thread::scope(|s| -> io::Result<()> {
            let mut work = Vec::new();
            for ((pair, out), into) in pairs.iter().zip(outs).zip(ins) {
                work.push(s.spawn(move || gather_out(&pair.0, &out)));
                work.push(s.spawn(move || scatter_in(&pair.1, into)));
            }
            work.into_iter().try_for_each(|w| w.join().unwrap_or_else(|_| Err(io::Error::other("a thread panicked"))))
        })?;
        let scatter_s = t.elapsed().as_secs_f64();
        ratio.push(hot_s / scatter_s);
        hot_t.push(hot_s);
        scatter_t.push(scatter_s);
    }
    let (lo, hi) = (ratio.iter().copied().fold(f64::MAX, f64::min), ratio.iter().copied().fold(0.0, f64::max));
    println!(
        "{{\"block\":{block},\"blocks\":{blocks},\"pool\":{pool},\"conns\":{conns},\"rounds\":{rounds},\
         \"hot_ms\":{:.3},\"scatter_ms\":{:.3},\"ratio\":{:.3},\"ratio_min\":{lo:.3},\"ratio_max\":{hi:.3}}}",
        median(hot_t) * 1e3,
        median(scatter_t) * 1e3,
        median(ratio)
    );
    Ok(())
}

/// `len` bytes of `fill`, anonymous, asking for transparent huge pages as an anonymous region does.
fn mapping(len: usize, fill: u8) -> io::Result<MmapMut> {
    let mut map = MmapMut::map_anon(len)?;
    let _ = map.advise(memmap2::Advice::HugePage);
    map.fill(fill);
    Ok(map)
}

/// `n` loopback connections, each as (sending end, receiving end).
fn connect(n: usize) -> io::Result<Vec<(TcpStream, TcpStream)>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    (0..n)
        .map(|_| {
            let tx = TcpStream::connect(addr)?;
            tx.set_nodelay(true)?;
            Ok((tx, listener.accept()?.0))
        })
        .collect()
}

fn stream_hot(mut s: &TcpStream, buf: &[u8], mut left: usize) -> io::Result<()> {
    while left > 0 {
        let k = left.min(buf.len());
        s.write_all(&buf[..k])?;
        left -= k;
    }
    Ok(())
}

fn drain_hot(mut s: &TcpStream, buf: &mut [u8], mut left: usize) -> io::Result<()> {
    while left > 0 {
        let k = left.min(buf.len());
        s.read_exact(&mut buf[..k])?;
        left -= k;
    }
    Ok(())
}

fn gather_out(mut s: &TcpStream, blocks: &[&[u8]]) -> io::Result<()> {
    for run in blocks.chunks(GATHER) {
        let mut iov: Vec<IoSlice<'_>> = run.iter().map(|b| IoSlice::new(b)).collect();
        let mut rest = &mut iov[..];
        while !rest.is_empty() {
            match s.write_vectored(rest)? {
                0 => return Err(io::ErrorKind::WriteZero.into()),
                n => IoSlice::advance_slices(&mut rest, n),
            }
        }
    }
    Ok(())
}

fn scatter_in(mut s: &TcpStream, mut blocks: Vec<&mut [u8]>) -> io::Result<()> {
    let mut at = 0;
    while at < blocks.len() {
        let end = (at + GATHER).min(blocks.len());
        let mut iov: Vec<IoSliceMut<'_>> = blocks[at..end].iter_mut().map(|b| IoSliceMut::new(b)).collect();
        let mut rest = &mut iov[..];
        while !rest.is_empty() {
            match s.read_vectored(rest)? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n => IoSliceMut::advance_slices(&mut rest, n),
            }
        }
        at = end;
    }
    Ok(())
}

/// `n` distinct slots of `slots`, in random order (a partial Fisher-Yates shuffle).
fn distinct(slots: usize, n: usize, seed: &mut u64) -> Vec<usize> {
    let mut all: Vec<usize> = (0..slots).collect();
    for i in 0..n {
        let j = i + (next(seed) % (slots - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    all
}
