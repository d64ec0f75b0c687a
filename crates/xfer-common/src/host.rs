//! Facts about a Linux process read from `/proc`: effective capabilities (for CAP_IPC_LOCK, which
//! verbs memory registration needs beyond RLIMIT_MEMLOCK). Shared by the agent's start-up log and
//! `xferctl doctor`.

/// Bit of CAP_IPC_LOCK in the capability sets.
pub const CAP_IPC_LOCK: u32 = 14;

/// The effective capability set (`CapEff:`) of a `/proc/PID/status` text; `None` if absent or
/// malformed.
pub fn cap_eff(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim();
    u64::from_str_radix(hex, 16).ok()
}

/// Whether capability `bit` is effective in a `/proc/PID/status` text; `None` if unknown.
pub fn has_cap(status: &str, bit: u32) -> Option<bool> {
    Some(cap_eff(status)? & (1u64 << bit) != 0)
}

/// Whether this process has CAP_IPC_LOCK; `false` when `/proc/self/status` cannot be read.
pub fn own_cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status").ok().and_then(|s| has_cap(&s, CAP_IPC_LOCK)).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cap_eff() {
        assert_eq!(has_cap("Name: x\nCapEff:\t0000000000004000\n", CAP_IPC_LOCK), Some(true));
        assert_eq!(has_cap("CapEff:\t0000000000000000\n", CAP_IPC_LOCK), Some(false));
        assert_eq!(has_cap("CapEff:\t000001ffffffffff\n", CAP_IPC_LOCK), Some(true));
        assert_eq!(has_cap("nothing", CAP_IPC_LOCK), None);
        assert_eq!(has_cap("CapEff:\tzz\n", CAP_IPC_LOCK), None);
    }
}
