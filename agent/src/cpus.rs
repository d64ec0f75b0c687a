//! Where the data-path worker thread runs (`verbs.worker_cpu`): the CPUs it is pinned to, and
//! the pinning itself.
//!
//! - **`auto`** (default) pins it to the device's NUMA node: the CPUs in
//!   `/sys/class/infiniband/DEV/device/local_cpulist` that this process may run on (its
//!   affinity mask, which a Kubernetes cpuset narrows). That is the data-plane practice for a
//!   NIC (Mooncake binds its per-NIC workers to the NIC's node): the worker's memory traffic
//!   and the NIC's DMA stay on one node, while the scheduler still balances it within the
//!   node. A device without a node (rxe and other software devices have no PCI parent), or a
//!   node this process may not run on, leaves the thread unpinned.
//! - **A CPU list** (`3`, `8-15`) pins it there; one CPU is what fabric-lib does per device.
//! - **`off`** leaves it to the scheduler.
//!
//! On Soft-RoCE one CPU is the choice for READ-heavy work. rxe runs the requester in the posting
//! thread and the rest of the transport in softirq on the CPU that sent each packet, so a
//! poster that moves between CPUs splits a QP's packets over two CPUs' backlogs, which deliver
//! them out of order; RC reads the gap as loss and goes back N (retries, duplicate requests,
//! responses sent twice). In one VM boot, READ 64 KiB ran at 0.72-0.75x perftest unpinned
//! (31-49 retries per 1,000 READs) and 0.84-0.87x on one CPU (0-5). WRITE 64 KiB lost on one
//! CPU (0.91-1.04x → 0.73-0.94x: all of rxe's copying then lands on that CPU) and the KV
//! pattern did not move beyond noise (0.92-1.01x → 0.88-1.00x), so `auto` does not pin where
//! the device names no node.
use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Largest CPU number accepted anywhere (the kernel's affinity masks here hold 1,024).
pub const MAX_CPU: usize = 1023;

/// The `verbs.worker_cpu` setting.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum WorkerCpu {
    /// The CPUs of the device's NUMA node this process may run on; unpinned without any.
    #[default]
    Auto,
    /// Not pinned.
    Off,
    /// These CPUs (not empty), all of which must be in the process's affinity mask.
    Cpus(BTreeSet<usize>),
}

impl TryFrom<String> for WorkerCpu {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(WorkerCpu::Auto),
            "off" => Ok(WorkerCpu::Off),
            list => match parse_cpulist(list) {
                Ok(cpus) if !cpus.is_empty() => Ok(WorkerCpu::Cpus(cpus)),
                Ok(_) => Err("must be auto, off or a CPU list (3, 0-3,8)".to_string()),
                Err(e) => Err(format!("{s:?} is not auto, off or a CPU list: {e}")),
            },
        }
    }
}

impl From<WorkerCpu> for String {
    fn from(w: WorkerCpu) -> String {
        w.to_string()
    }
}

impl fmt::Display for WorkerCpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerCpu::Auto => f.write_str("auto"),
            WorkerCpu::Off => f.write_str("off"),
            WorkerCpu::Cpus(c) => f.write_str(&format_cpulist(c)),
        }
    }
}

/// A kernel CPU list (`0-3,8,10-11`, as sysfs and cpusets print it).
pub fn parse_cpulist(text: &str) -> Result<BTreeSet<usize>, String> {
    let mut set = BTreeSet::new();
    let text = text.trim();
    if text.is_empty() {
        return Ok(set);
    }
    let num = |s: &str| -> Result<usize, String> {
        match s.trim().parse::<usize>() {
            Ok(n) if n <= MAX_CPU => Ok(n),
            Ok(n) => Err(format!("CPU {n} is out of range (0..={MAX_CPU})")),
            Err(_) => Err(format!("{s:?} is not a CPU number")),
        }
    };
    for part in text.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("range {part:?} runs backwards"));
                }
                set.extend(a..=b);
            }
            None => {
                set.insert(num(part)?);
            }
        }
    }
    Ok(set)
}

/// Prints a CPU set as a CPU list (`0-3,8`).
pub fn format_cpulist(set: &BTreeSet<usize>) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut it = set.iter().copied().peekable();
    while let Some(start) = it.next() {
        let mut end = start;
        while it.peek() == Some(&(end + 1)) {
            end += 1;
            it.next();
        }
        out.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
    }
    out.join(",")
}

/// The CPUs the calling thread may run on (the process's mask unless it was changed).
pub fn allowed() -> Result<BTreeSet<usize>, String> {
    let mask = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_err(|e| format!("reading the CPU affinity mask: {e}"))?;
    Ok((0..=MAX_CPU.min(nix::sched::CpuSet::count() - 1)).filter(|&c| mask.is_set(c).unwrap_or(false)).collect())
}

/// The CPUs of `device`'s NUMA node, from sysfs; `None` when the device has none to tell (rxe
/// and other software devices have no PCI parent) or the name is not a plain device name.
pub fn device_local(device: &str) -> Option<BTreeSet<usize>> {
    if device.is_empty() || device.contains(['/', '\0']) || device == "." || device == ".." {
        return None;
    }
    let text = std::fs::read_to_string(format!("/sys/class/infiniband/{device}/device/local_cpulist")).ok()?;
    parse_cpulist(&text).ok().filter(|s| !s.is_empty())
}

/// Why [`choose`] picked its CPUs (for the start-up log).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Configured,
    NumaLocal,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Reason::Configured => "configured",
            Reason::NumaLocal => "the device's NUMA node, within this process's CPUs",
        })
    }
}

/// The CPUs `setting` pins the worker to, given the CPUs this process may run on and the
/// device's local ones: `Ok(None)` = unpinned (`off`, or `auto` with no local CPU allowed); an
/// error for configured CPUs the process may not run on.
pub fn choose(
    setting: &WorkerCpu,
    allowed: &BTreeSet<usize>,
    local: Option<&BTreeSet<usize>>,
) -> Result<Option<(BTreeSet<usize>, Reason)>, String> {
    match setting {
        WorkerCpu::Off => Ok(None),
        WorkerCpu::Cpus(c) => {
            let outside: BTreeSet<usize> = c.difference(allowed).copied().collect();
            if outside.is_empty() {
                Ok(Some((c.clone(), Reason::Configured)))
            } else {
                Err(format!("CPUs {} are not ones this process may run on ({})", format_cpulist(&outside), format_cpulist(allowed)))
            }
        }
        WorkerCpu::Auto => {
            let near: BTreeSet<usize> = local.map(|l| allowed.intersection(l).copied().collect()).unwrap_or_default();
            Ok((!near.is_empty()).then_some((near, Reason::NumaLocal)))
        }
    }
}

/// Pins the calling thread to `cpus`.
pub fn pin_current_thread(cpus: &BTreeSet<usize>) -> Result<(), String> {
    let mut set = nix::sched::CpuSet::new();
    for &cpu in cpus {
        set.set(cpu).map_err(|e| format!("CPU {cpu}: {e}"))?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(|e| format!("pinning to CPUs {}: {e}", format_cpulist(cpus)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[usize]) -> BTreeSet<usize> {
        v.iter().copied().collect()
    }

    #[test]
    fn cpu_lists_parse_as_the_kernel_prints_them() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), Ok(set(&[0, 1, 2, 3, 8, 10, 11])));
        assert_eq!(parse_cpulist("5"), Ok(set(&[5])));
        assert_eq!(parse_cpulist(""), Ok(set(&[])));
        assert_eq!(format_cpulist(&set(&[0, 1, 2, 3, 8, 10, 11])), "0-3,8,10-11");
        assert_eq!(format_cpulist(&set(&[])), "");
    }

    #[test]
    fn malformed_cpu_lists_are_refused_with_the_reason() {
        for (text, why) in [
            ("3-1", "backwards"),
            ("0-", "not a CPU number"),
            ("a", "not a CPU number"),
            ("1,,2", "not a CPU number"),
            ("-1", "not a CPU number"),
            ("0-4096", "out of range"),
            ("99999999999999999999999", "not a CPU number"),
        ] {
            let e = parse_cpulist(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn settings_parse_and_print() {
        assert_eq!(WorkerCpu::try_from("auto".to_string()), Ok(WorkerCpu::Auto));
        assert_eq!(WorkerCpu::try_from(" OFF ".to_string()), Ok(WorkerCpu::Off));
        assert_eq!(WorkerCpu::try_from("7".to_string()), Ok(WorkerCpu::Cpus(set(&[7]))));
        assert_eq!(WorkerCpu::try_from("0-2,8".to_string()), Ok(WorkerCpu::Cpus(set(&[0, 1, 2, 8]))));
        for (v, why) in
            [("1024", "out of range"), ("-1", "not a CPU number"), ("fast", "not a CPU number"), ("", "must be auto, off or a CPU list")]
        {
            let e = WorkerCpu::try_from(v.to_string()).unwrap_err();
            assert!(e.contains(why), "{v:?}: {e}");
        }
        for w in [WorkerCpu::Auto, WorkerCpu::Off, WorkerCpu::Cpus(set(&[3])), WorkerCpu::Cpus(set(&[0, 1, 2, 3, 8]))] {
            assert_eq!(WorkerCpu::try_from(w.to_string()), Ok(w));
        }
    }

    #[test]
    fn auto_pins_to_the_devices_numa_node_within_the_allowed_set_or_not_at_all() {
        let allowed = set(&[0, 1, 2, 3, 8, 9]);
        let node1 = set(&[8, 9, 10, 11, 12, 13, 14, 15]);
        assert_eq!(choose(&WorkerCpu::Auto, &allowed, Some(&node1)), Ok(Some((set(&[8, 9]), Reason::NumaLocal))));
        // No allowed CPU on the device's node (a cpuset elsewhere), or a software device with
        // no node: unpinned.
        assert_eq!(choose(&WorkerCpu::Auto, &allowed, Some(&set(&[16, 17]))), Ok(None));
        assert_eq!(choose(&WorkerCpu::Auto, &allowed, None), Ok(None));
        assert_eq!(choose(&WorkerCpu::Off, &allowed, Some(&node1)), Ok(None));
    }

    #[test]
    fn configured_cpus_must_all_be_allowed() {
        let allowed = set(&[0, 1, 2, 3]);
        assert_eq!(choose(&WorkerCpu::Cpus(set(&[2])), &allowed, None), Ok(Some((set(&[2]), Reason::Configured))));
        let e = choose(&WorkerCpu::Cpus(set(&[2, 7, 8])), &allowed, Some(&set(&[7]))).unwrap_err();
        assert!(e.contains("CPUs 7-8") && e.contains("(0-3)"), "{e}");
    }

    #[test]
    fn device_names_never_leave_the_infiniband_class_directory() {
        for name in ["", ".", "..", "../../../etc", "rxe0/../../x", "a\0b"] {
            assert_eq!(device_local(name), None, "{name:?}");
        }
    }

    #[test]
    fn a_thread_is_pinned_to_exactly_the_cpus_asked_and_cpus_outside_its_mask_are_refused() {
        let allowed = allowed().expect("affinity mask");
        let &cpu = allowed.last().expect("at least one CPU");
        let pinned = |cpus: BTreeSet<usize>| {
            std::thread::spawn(move || (pin_current_thread(&cpus), self::allowed().expect("mask"))).join().expect("thread")
        };
        let (r, seen) = pinned(set(&[cpu]));
        assert_eq!((r, seen), (Ok(()), set(&[cpu])));
        let (r, seen) = pinned(allowed.clone());
        assert_eq!((r, seen), (Ok(()), allowed.clone()));
        // A CPU the mask does not hold (MAX_CPU, unless this machine has 1,024): refused, and
        // the thread's mask is unchanged.
        if !allowed.contains(&MAX_CPU) {
            let (r, after) = pinned(set(&[MAX_CPU]));
            assert!(r.unwrap_err().contains(&format!("CPUs {MAX_CPU}")));
            assert_eq!(after, allowed);
        }
        // Past the mask type's range: refused before any syscall.
        assert!(pin_current_thread(&set(&[usize::MAX])).is_err());
    }
}
