//! Facts about the process the agent runs in: locked-memory limit and capabilities.

/// RLIMIT_MEMLOCK (soft, hard) in bytes; `u64::MAX` means unlimited.
pub fn memlock() -> (u64, u64) {
    use nix::sys::resource::{getrlimit, Resource};
    getrlimit(Resource::RLIMIT_MEMLOCK).unwrap_or((0, 0))
}

/// Whether CAP_IPC_LOCK (bit 14) is in the effective set, from /proc/self/status.
pub fn cap_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status").ok().and_then(|s| cap_eff_has(&s, 14)).unwrap_or(false)
}

fn cap_eff_has(status: &str, bit: u32) -> Option<bool> {
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    let v = u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()?;
    Some(v & (1 << bit) != 0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_cap_eff() {
        assert_eq!(super::cap_eff_has("Name: x\nCapEff:\t0000000000004000\n", 14), Some(true));
        assert_eq!(super::cap_eff_has("CapEff:\t0000000000000000\n", 14), Some(false));
        assert_eq!(super::cap_eff_has("nothing", 14), None);
    }
}
