//! The TCP fabric's initiator side, fed a hostile target's answers.
//!
//! The input's first byte says how many WRs (1 to 8) the initiator posts, the next 4 bytes per WR
//! say what each is (WRITE, READ or NOTIFY; length; local offset; signaled or not), and the rest
//! is the byte stream the target answers with (ACK, NAK, READ_RESP frames, or anything else),
//! read by `fabric::tcp::run_initiator_stream` in memory: no sockets. Whatever the answers hold:
//! the stream ends; no WR completes twice, every signaled one completes, an unsignaled one never
//! with success; and no answer lands outside the local ranges the READs named (the upper half of
//! the memory, which no READ names, keeps its bytes).
#![no_main]

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use xfer_fabric::tcp::{registration, run_initiator_stream};
use xfer_fabric::{Access, RemoteKey, WcStatus, WorkRequest, WrOp};
use xfer_rdma::memory::RegionMemory;

const LEN: usize = 64 << 10;
/// READs land only below this offset.
const READ_AREA: u64 = 32 << 10;
const TOKEN: [u8; 16] = [0x22; 16];

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("tokio runtime"))
}

fn pattern(i: usize) -> u8 {
    (i as u8).wrapping_mul(31).wrapping_add(7)
}

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else { return };
    let n = usize::from(n % 8) + 1;
    if rest.len() < n * 4 {
        return;
    }
    let (specs, answers) = rest.split_at(n * 4);
    let memory = Arc::new(RegionMemory::anonymous(LEN, false).expect("64 KiB anonymous mapping"));
    let fill: Vec<u8> = (0..LEN).map(pattern).collect();
    memory.write_at(0, &fill).expect("fill");
    let local = registration(memory.clone(), Access::ReadWrite);
    let wrs: Vec<WorkRequest> = specs
        .chunks_exact(4)
        .enumerate()
        .map(|(i, s)| {
            let len = u32::from(u16::from_le_bytes([s[1], s[2]])) % (READ_AREA as u32 / 2 + 1);
            let offset = (u64::from(s[3]) * 128) % (READ_AREA / 2);
            let op = match s[0] % 3 {
                0 => WrOp::Write,
                1 => WrOp::Read,
                _ => WrOp::Notify { slot: u32::from(s[1]) },
            };
            WorkRequest {
                wr_id: i as u64,
                op,
                local: local.clone(),
                local_offset: offset,
                len: if matches!(op, WrOp::Notify { .. }) { 0 } else { len },
                remote_addr: 0x1_0000,
                remote_key: RemoteKey::Token(TOKEN),
                signaled: s[0] & 0x80 != 0,
            }
        })
        .collect();
    let rd = std::io::Cursor::new(answers.to_vec());
    let (completions, refused) = runtime().block_on(run_initiator_stream(rd, tokio::io::sink(), wrs));
    // At most one completion per WR; exactly one for every posted signaled WR (the posted WRs
    // are the first ones); success only for a signaled WR (an unsignaled one completes silently).
    let ids: HashSet<u64> = completions.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids.len(), completions.len(), "a WR completed twice: {completions:?}");
    let posted = n - refused;
    for (i, s) in specs.chunks_exact(4).enumerate().take(posted) {
        if s[0] & 0x80 != 0 {
            assert!(ids.contains(&(i as u64)), "signaled WR {i} lost its completion: {completions:?}");
        }
    }
    for c in &completions {
        assert!(c.wr_id < posted as u64, "a completion for a WR never posted: {c:?}");
        if c.status == WcStatus::Success {
            assert!(specs[c.wr_id as usize * 4] & 0x80 != 0, "an unsignaled WR completed successfully: {c:?}");
        }
    }
    // Nothing landed where no READ points.
    let mut upper = vec![0u8; LEN - READ_AREA as usize];
    memory.read_at(READ_AREA, &mut upper).expect("read back");
    assert!(upper.iter().enumerate().all(|(i, b)| *b == pattern(READ_AREA as usize + i)), "bytes changed outside every READ");
});
