//! The verbs fabric's settings (`verbs.*` in the configuration): devices and port, GID, QP
//! timeouts and retries, CQ size, grant mode, prebuilt connections, marker spin.
use crate::FabricError;

/// How the verbs fabric's grants expose memory (`verbs.grant_mode`). A property of
/// the fabric, fixed when it opens: tcp always uses tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum GrantMode {
    /// A dedicated MR over exactly the granted range.
    Mr,
    /// A type-2 memory window bound to the range on each responder QP of the grantee's
    /// connection (`ExposeRequest::connection`). Range-safe only on devices that enforce window
    /// bounds: rxe (6.1) checks an access against the underlying MR, not the window.
    Mw,
    /// The region MR's rkey (fastest, least scoped).
    Region,
}

impl TryFrom<String> for GrantMode {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        xfer_common::one_of(&s, &[("mr", GrantMode::Mr), ("mw", GrantMode::Mw), ("region", GrantMode::Region)])
    }
}

/// One entry of `verbs.devices`: `name`, `name:port` or `name:port:gid_index` (`mlx5_1:1`,
/// `rxe0:1:1`). What it leaves out comes from `verbs.port` and `verbs.gid_index`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub name: String,
    pub port: Option<u8>,
    pub gid_index: Option<u32>,
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<DeviceSpec, String> {
        let mut parts = s.trim().split(':');
        let name = parts.next().unwrap_or_default().trim();
        if name.is_empty() {
            return Err(format!("{s:?}: a device name is required (`mlx5_0`, `mlx5_0:1`, `rxe0:1:1`)"));
        }
        if name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) {
            return Err(format!("{name:?} is not a device name (letters, digits, `_`, `-`, `.`; at most 64)"));
        }
        let port = match parts.next() {
            None => None,
            Some(p) => match p.trim().parse::<u8>() {
                Ok(p) if p >= 1 => Some(p),
                _ => return Err(format!("{s:?}: port {p:?} is not a port number (1-255)")),
            },
        };
        let gid_index = match parts.next() {
            None => None,
            Some(g) => Some(g.trim().parse::<u32>().map_err(|_| format!("{s:?}: GID index {g:?} is not a number"))?),
        };
        if parts.next().is_some() {
            return Err(format!("{s:?}: expected name[:port[:gid_index]]"));
        }
        Ok(DeviceSpec { name: name.to_string(), port, gid_index })
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)?;
        match (self.port, self.gid_index) {
            (Some(p), Some(g)) => write!(f, ":{p}:{g}"),
            (Some(p), None) => write!(f, ":{p}"),
            (None, Some(g)) => write!(f, "::{g}"),
            (None, None) => Ok(()),
        }
    }
}

/// Most devices `verbs.devices` may list: each offers a rail of its own, and a peer refuses
/// rail numbers of 64 and above (a connection carries at most 64 QPs).
pub const MAX_DEVICES: usize = 64;

/// Most connections per shape `verbs.prebuilt` may ask for.
pub const MAX_PREBUILT: usize = 16;

/// Settings of the verbs fabric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsOptions {
    /// One device by name (`mlx5_0`, `rxe0`, `verbs.device`); `None` = as `devices` says.
    pub device: Option<String>,
    /// The devices to use (`verbs.devices`); `None` = every device whose port is usable now or
    /// once its link is up (`auto`, see `select::auto_pick`). Refused together with `device`.
    pub devices: Option<Vec<DeviceSpec>>,
    /// Port number (1-based).
    pub port: u8,
    /// GID index; `None` = the RoCEv2 IPv4-mapped GID of `bind_ip`, else the first RoCEv2
    /// IPv4-mapped GID.
    pub gid_index: Option<u32>,
    /// The agent's own address, used to pick the GID on the netdev that carries it.
    pub bind_ip: Option<std::net::IpAddr>,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout per try. With `retry_cnt` 6 the default
    /// (16, ≈268 ms) declares a dead peer after ≈ 7 × 268 ms ≈ 1.9 s.
    pub timeout: u8,
    /// Transport retries, at most 6 (7 means "retry forever" and on rxe a WRITE to a dead peer
    /// then never completes).
    pub retry_cnt: u8,
    /// RNR retries, below 7 (7 = forever).
    pub rnr_retry: u8,
    /// Outstanding RDMA READs per QP (initiator depth / responder resources); capped by the
    /// device; 0 = the device's maximum (`verbs.max_rd_atomic`).
    pub max_rd_atomic: u8,
    /// Minimum CQ size; the fabric grows it to hold `qps × depth` completions.
    pub cq_size: usize,
    /// Poll the CQ in a loop instead of waiting for completion events (lower latency, one core).
    pub busy_poll: bool,
    /// How grants expose memory (`verbs.grant_mode`). It decides the region MR's
    /// access: local only in `mr` and `mw` (plus window binding in `mw`, whose responder QPs can
    /// also post binds), remote access from the ceiling only in `region`.
    pub grant_mode: GrantMode,
    /// Connections of each recently used shape kept built and in INIT ahead of need
    /// (`verbs.prebuilt`, [`super::prebuilt`]); 0 builds every connection during its negotiation.
    pub prebuilt: usize,
    /// The connection shape (QPs, depth) transfers use unless they ask otherwise
    /// (`transfer.qps`, `transfer.depth`): the pool builds it, both halves, from the start, so
    /// even the first negotiation finds one ready.
    pub expected_shape: Option<(usize, usize)>,
    /// How long a responder busy-polls a connection's marker receives after a grant with a
    /// notification (or a channel batch's announcement) on it, at most (`verbs.marker_spin`);
    /// zero leaves markers to the completion channel alone.
    pub marker_spin: std::time::Duration,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        VerbsOptions {
            device: None,
            devices: None,
            port: 1,
            gid_index: None,
            bind_ip: None,
            timeout: 16,
            retry_cnt: 6,
            rnr_retry: 6,
            max_rd_atomic: 0,
            cq_size: 1024,
            busy_poll: false,
            grant_mode: GrantMode::Mr,
            prebuilt: 2,
            expected_shape: None,
            marker_spin: std::time::Duration::from_millis(50),
        }
    }
}

impl VerbsOptions {
    /// Rejects settings that would make a QP hang forever or that the spec forbids.
    pub fn validate(&self) -> Result<(), FabricError> {
        let bad = |attr: &'static str, detail: String| FabricError::Negotiation { step: "options", attr, detail };
        if self.port == 0 {
            return Err(bad("port", "ports are numbered from 1".into()));
        }
        if let (Some(one), Some(list)) = (&self.device, &self.devices) {
            let names: Vec<String> = list.iter().map(ToString::to_string).collect();
            return Err(bad(
                "devices",
                format!(
                    "both verbs.device ({one}) and verbs.devices ({}) are set: keep one (verbs.devices = [\"{one}\"] for one device)",
                    names.join(",")
                ),
            ));
        }
        if let Some(list) = &self.devices {
            if list.is_empty() {
                return Err(bad("devices", "the list is empty (leave it out, or `auto`, for every usable device)".into()));
            }
            if list.len() > MAX_DEVICES {
                return Err(bad(
                    "devices",
                    format!(
                        "{} devices listed, at most {MAX_DEVICES} (one rail each, and a peer takes rails 0-{})",
                        list.len(),
                        MAX_DEVICES - 1
                    ),
                ));
            }
            for (i, d) in list.iter().enumerate() {
                if list[..i].iter().any(|e| e.name == d.name) {
                    return Err(bad("devices", format!("device {} is listed twice (each device carries at most one path)", d.name)));
                }
            }
        }
        if self.timeout == 0 || self.timeout > 31 {
            return Err(bad("timeout", format!("{} is outside 1..=31 (0 would wait forever)", self.timeout)));
        }
        if self.retry_cnt > 6 {
            return Err(bad("retry_cnt", format!("{} > 6 (7 retries forever)", self.retry_cnt)));
        }
        if self.rnr_retry > 6 {
            return Err(bad("rnr_retry", format!("{} > 6 (7 retries forever)", self.rnr_retry)));
        }
        if self.prebuilt > MAX_PREBUILT {
            return Err(bad("prebuilt", format!("{} connections per shape asked, at most {MAX_PREBUILT}", self.prebuilt)));
        }
        Ok(())
    }

    /// Grant mode `mw`: region MRs allow window binding and responder QPs can post binds.
    pub fn mw_grants(&self) -> bool {
        self.grant_mode == GrantMode::Mw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_name_port_and_gid() {
        let d: DeviceSpec = "mlx5_0".parse().unwrap();
        assert_eq!(d, DeviceSpec { name: "mlx5_0".into(), port: None, gid_index: None });
        let d: DeviceSpec = "rxe0:1:3".parse().unwrap();
        assert_eq!(d, DeviceSpec { name: "rxe0".into(), port: Some(1), gid_index: Some(3) });
        assert_eq!(d.to_string(), "rxe0:1:3");
        assert_eq!("mlx5_1:2".parse::<DeviceSpec>().unwrap().port, Some(2));
        for bad in ["", ":1", "rxe0:0", "rxe0:x", "rxe0:1:y", "rxe0:1:1:1", "a b"] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn device_and_devices_together_are_refused() {
        let opts = VerbsOptions { device: Some("rxe0".into()), devices: Some(vec!["rxe1".parse().unwrap()]), ..VerbsOptions::default() };
        let e = opts.validate().unwrap_err().to_string();
        assert!(e.contains("both verbs.device (rxe0) and verbs.devices (rxe1)"), "{e}");
        let twice = VerbsOptions { devices: Some(vec!["rxe0".parse().unwrap(), "rxe0:1".parse().unwrap()]), ..VerbsOptions::default() };
        assert!(twice.validate().unwrap_err().to_string().contains("listed twice"));
    }

    /// What a careless operator (or a hostile environment variable) can put in `verbs.devices`:
    /// each entry is refused with what is wrong in it, before any device is opened.
    #[test]
    fn hostile_device_lists_are_refused_with_the_entry() {
        for (entry, why) in [
            ("../x", "is not a device name"),
            ("/dev/infiniband/uverbs0", "is not a device name"),
            ("rxe\n0", "is not a device name"),
            ("rxe0:0", "is not a port number"),
            ("rxe0:256", "is not a port number"),
            ("rxe0:-1", "is not a port number"),
            ("rxe0:1:99999999999", "is not a number"),
            ("rxe0:1:-1", "is not a number"),
            ("rxe0::", "is not a port number"),
            ("rxe0:1:2:3", "expected name[:port[:gid_index]]"),
            ("", "a device name is required"),
            (":1", "a device name is required"),
        ] {
            let e = entry.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains(why), "{entry:?}: {e}");
        }
        let long = "d".repeat(65);
        assert!(long.parse::<DeviceSpec>().unwrap_err().contains("at most 64"));
        assert_eq!("d".repeat(64).parse::<DeviceSpec>().unwrap().name.len(), 64);
        let with = |list: Vec<DeviceSpec>| VerbsOptions { devices: Some(list), ..VerbsOptions::default() }.validate();
        assert!(with(Vec::new()).unwrap_err().to_string().contains("the list is empty"));
        let many: Vec<DeviceSpec> = (0..10_000).map(|i| format!("rxe{i}").parse().unwrap()).collect();
        let e = with(many.clone()).unwrap_err().to_string();
        assert!(e.contains("10000 devices listed, at most 64"), "{e}");
        assert!(with(many[..MAX_DEVICES].to_vec()).is_ok());
        assert!(with(many[..MAX_DEVICES + 1].to_vec()).is_err());
        // Duplicates differ only in port or GID: still one device listed twice.
        let e = with(vec!["rxe0:1:1".parse().unwrap(), "rxe1".parse().unwrap(), " rxe0 ".parse().unwrap()]).unwrap_err();
        assert!(e.to_string().contains("device rxe0 is listed twice"), "{e}");
    }
}
