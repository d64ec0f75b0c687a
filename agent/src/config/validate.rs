//! What a loaded configuration must satisfy beyond its types: the ranges of each key, that the
//! verbs options are ones the fabric accepts, that mTLS files exist, and that plaintext is only
//! served on loopback unless the operator says otherwise.

use xfer_common::ByteSize;

use super::bounds;
use super::error::{bad, ConfigError};
use super::root::Config;

/// Upper bounds of `transfer.max_segments` and `transfer.max_notify_bytes`. A segment costs at
/// most ~35 bytes of a SubmitTransfer message, so the default 65,536 fit gRPC's 4 MiB message
/// limit; the ceiling only keeps a typo from disabling the bound. A tag is metadata, not data.
const MAX_SEGMENTS_CEILING: usize = 1 << 20;
const MAX_NOTIFY_CEILING: usize = 64 << 10;

impl Config {
    /// Whether a connection of `transfer.qps` QPs on each of `devices` devices (and the tcp
    /// fallback's endpoint) fits one `Peer.Connect` offer; a peer would refuse every connection
    /// otherwise, so the agent refuses to start, naming both numbers.
    pub fn check_endpoints(&self, devices: usize) -> Result<(), ConfigError> {
        let fallback = self.transfer.fallback == super::Fallback::Tcp;
        xfer_engine::shape::connection_endpoints(self.transfer.qps, devices, fallback).map(|_| ()).map_err(|e| bad("transfer.qps", e))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        // Every duration and size first: nothing accepted may overflow a deadline or a sum later.
        bounds::check(self)?;
        let t = &self.transfer;
        xfer_engine::shape::chunk(t.chunk_size.0)
            .map_err(|_| bad("transfer.chunk_size", format!("must be between 1 and {}", ByteSize(xfer_engine::shape::MAX_CHUNK))))?;
        xfer_engine::shape::depth(t.depth).map_err(|e| bad("transfer.depth", e.to_string()))?;
        xfer_engine::shape::qps(t.qps).map_err(|e| bad("transfer.qps", e.to_string()))?;
        if !(1..=MAX_SEGMENTS_CEILING).contains(&t.max_segments) {
            return Err(bad("transfer.max_segments", format!("must be between 1 and {MAX_SEGMENTS_CEILING}")));
        }
        // Each resume is a Peer.Connect and a grant: a handful is plenty for links that flap.
        if t.resume_attempts > 8 {
            return Err(bad("transfer.resume_attempts", "must be at most 8".to_string()));
        }
        if t.max_notify_bytes > MAX_NOTIFY_CEILING {
            return Err(bad("transfer.max_notify_bytes", format!("must be at most {MAX_NOTIFY_CEILING}")));
        }
        match self.verbs.device_specs() {
            Err((i, e)) => return Err(bad(&format!("verbs.devices[{i}]"), e)),
            // Listed devices: every connection offers transfer.qps on each (`auto`'s count is
            // known once the devices are open, and checked then).
            Ok(Some(list)) if self.fabric != super::FabricChoice::Tcp => self.check_endpoints(list.len())?,
            Ok(_) => {}
        }
        // The verbs fabric's own checks (one place for the retry and timeout bounds).
        self.verbs_options().validate().map_err(|e| match e {
            xfer_fabric::FabricError::Negotiation { attr, detail, .. } => bad(&format!("verbs.{attr}"), detail),
            other => bad("verbs", other.to_string()),
        })?;
        if !(4096..=xfer_engine::shape::MAX_CHUNK).contains(&self.verbs.max_read_wr.0) {
            return Err(bad("verbs.max_read_wr", format!("must be between 4KiB and {}", ByteSize(xfer_engine::shape::MAX_CHUNK))));
        }
        if let crate::cpus::WorkerCpu::Cpus(_) = self.verbs.worker_cpu {
            // Only CPUs this process may run on (its affinity mask, which a cpuset narrows).
            let allowed = crate::cpus::allowed().map_err(|e| bad("verbs.worker_cpu", e))?;
            crate::cpus::choose(&self.verbs.worker_cpu, &allowed, None).map_err(|e| bad("verbs.worker_cpu", e))?;
        }
        if self.verbs.gid_index < -1 {
            return Err(bad("verbs.gid_index", "must be -1 (auto) or a GID table index"));
        }
        if !self.insecure {
            for (key, path) in [("tls.cert", &self.tls.cert), ("tls.key", &self.tls.key), ("tls.ca", &self.tls.ca)] {
                if path.is_empty() {
                    return Err(bad(key, "is required when insecure = false (mTLS)"));
                }
                if !std::path::Path::new(path).is_file() {
                    return Err(bad(key, format!("file {path} does not exist")));
                }
            }
        }
        if self.node_name.is_empty() || self.node_name.len() > 253 {
            return Err(bad("node_name", "must be 1-253 characters"));
        }
        if self.limits.max_peer_labels == 0 {
            return Err(bad("limits.max_peer_labels", "must be at least 1"));
        }
        for (key, v) in [
            ("limits.max_data_connections", self.limits.max_data_connections),
            ("limits.max_data_connections_per_peer", self.limits.max_data_connections_per_peer),
            ("limits.max_pending_data_connections", self.limits.max_pending_data_connections),
            ("limits.max_grpc_connections", self.limits.max_grpc_connections),
            ("limits.max_peers", self.limits.max_peers),
            ("limits.max_connections_per_peer", self.limits.max_connections_per_peer),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1"));
            }
        }
        if self.limits.max_connections_per_peer > 4096 {
            return Err(bad("limits.max_connections_per_peer", "must be at most 4096"));
        }
        let share = self.limits.tenant_share;
        if !(share > 0.0 && share <= 1.0) {
            return Err(bad("limits.tenant_share", format!("must be a fraction in (0, 1], not {share}")));
        }
        for (key, v) in [
            ("limits.data_handshake_timeout", self.limits.data_handshake_timeout.0),
            ("limits.data_idle_timeout", self.limits.data_idle_timeout.0),
            ("limits.data_payload_timeout", self.limits.data_payload_timeout.0),
        ] {
            if v.is_zero() {
                return Err(bad(key, "must be longer than 0"));
            }
        }
        for (i, r) in self.tls.dns_roles.iter().enumerate() {
            xfer_fabric::identity::check_dns_pattern(&r.pattern).map_err(|e| bad(&format!("tls.dns_roles[{i}].pattern"), e))?;
        }
        if !self.tls.trust_domain.is_empty() {
            xfer_fabric::identity::check_trust_domain(&self.tls.trust_domain).map_err(|e| bad("tls.trust_domain", e))?;
        }
        self.regions.validate()?;
        if self.unix_mode.0 & !0o777 != 0 {
            return Err(bad("unix_mode", format!("{:o} has bits beyond 0777 (setuid, setgid, sticky)", self.unix_mode.0)));
        }
        self.unix_gid()?;
        self.check_plaintext()
    }

    /// Secure by default: plaintext only where nobody else can connect (loopback), unless the
    /// operator opts in with `allow_plaintext_network`. Metrics and the health listener serve
    /// nothing that changes state or reveals data and are not checked.
    fn check_plaintext(&self) -> Result<(), ConfigError> {
        if !self.insecure || self.allow_plaintext_network {
            return Ok(());
        }
        for (key, a) in [("listen", self.listen), ("data_listen", self.data_listen_addr())] {
            if !a.ip().is_loopback() {
                return Err(bad(
                    "allow_plaintext_network",
                    format!(
                        "plaintext gRPC (insecure = true) with {key} = {a}, which is not a loopback address: \
                         anyone who reaches it could read and write this node's memory. Turn on mTLS \
                         (insecure = false with tls.cert, tls.key, tls.ca), listen on 127.0.0.1, or set \
                         allow_plaintext_network = true (env XFER_ALLOW_PLAINTEXT_NETWORK=true) to accept that"
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::super::{ByteSize, Config, FileMode, Overrides};

    #[test]
    fn worker_cpu_is_auto_off_or_cpus_this_process_may_run_on() {
        use crate::cpus::WorkerCpu;
        let one = |c: usize| WorkerCpu::Cpus([c].into_iter().collect());
        let env = |v: &str| vec![("XFER_VERBS__WORKER_CPU".to_string(), v.to_string())];
        assert_eq!(Config::load(None, vec![], &Overrides::default()).unwrap().verbs.worker_cpu, WorkerCpu::Auto, "default");
        assert_eq!(Config::load(None, env("off"), &Overrides::default()).unwrap().verbs.worker_cpu, WorkerCpu::Off);
        let &cpu = crate::cpus::allowed().unwrap().last().unwrap();
        assert_eq!(Config::load(None, env(&cpu.to_string()), &Overrides::default()).unwrap().verbs.worker_cpu, one(cpu));
        // A file's integer, as TOML writes it, and the printed form loads back.
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, format!("[verbs]\nworker_cpu = {cpu}\n")).unwrap();
        let c = Config::load(Some(&f), vec![], &Overrides::default()).unwrap();
        assert_eq!(c.verbs.worker_cpu, one(cpu));
        assert!(c.to_toml().contains(&format!("worker_cpu = \"{cpu}\"")), "{}", c.to_toml());
        // Not a setting, past the mask type, or a CPU outside this process's mask: refused,
        // naming the key.
        for v in ["fast", "-1", "1024", "3-1", ""] {
            let e = Config::load(None, env(v), &Overrides::default()).unwrap_err();
            assert!(e.to_string().contains("worker_cpu"), "{v}: {e}");
        }
        if !crate::cpus::allowed().unwrap().contains(&crate::cpus::MAX_CPU) {
            let e = Config::load(None, env(&crate::cpus::MAX_CPU.to_string()), &Overrides::default()).unwrap_err();
            assert_eq!(e.key, "verbs.worker_cpu");
            assert!(e.problem.contains("may run on"), "{e}");
            // One CPU outside the mask spoils a list.
            let e = Config::load(None, env(&format!("{cpu},{}", crate::cpus::MAX_CPU)), &Overrides::default()).unwrap_err();
            assert_eq!(e.key, "verbs.worker_cpu");
        }
    }

    #[test]
    fn exhaustion_limits_load_from_env_and_refuse_zero() {
        let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let c = Config::load(None, env(&[]), &Overrides::default()).unwrap();
        assert_eq!(c.limits.max_data_connections, 4096);
        assert_eq!(c.limits.max_data_connections_per_peer, 256);
        assert_eq!(c.limits.max_pending_data_connections, 128);
        assert_eq!(c.limits.max_grpc_connections, 1024);
        assert_eq!(c.limits.data_handshake_timeout.0, Duration::from_secs(10));
        assert_eq!(c.limits.data_idle_timeout.0, Duration::from_secs(300));
        assert_eq!(c.limits.data_payload_timeout.0, Duration::from_secs(30));
        assert_eq!(c.limits.grpc_keepalive(), Some(Duration::from_secs(30)));
        assert_eq!(c.limits.max_peers, 1024);
        let c = Config::load(
            None,
            env(&[
                ("XFER_LIMITS__DATA_IDLE_TIMEOUT", "200ms"),
                ("XFER_LIMITS__DATA_PAYLOAD_TIMEOUT", "300ms"),
                ("XFER_LIMITS__MAX_DATA_CONNECTIONS_PER_PEER", "4"),
            ]),
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.limits.data_idle_timeout.0, Duration::from_millis(200));
        assert_eq!(c.limits.data_payload_timeout.0, Duration::from_millis(300));
        assert_eq!(c.limits.max_data_connections_per_peer, 4);
        for key in ["MAX_DATA_CONNECTIONS", "MAX_DATA_CONNECTIONS_PER_PEER", "MAX_PEERS"] {
            let e = Config::load(None, env(&[(&format!("XFER_LIMITS__{key}"), "0")]), &Overrides::default()).unwrap_err();
            assert_eq!(e.key, format!("limits.{}", key.to_lowercase()));
        }
        for key in ["DATA_HANDSHAKE_TIMEOUT", "DATA_IDLE_TIMEOUT", "DATA_PAYLOAD_TIMEOUT"] {
            let e = Config::load(None, env(&[(&format!("XFER_LIMITS__{key}"), "0s")]), &Overrides::default()).unwrap_err();
            assert_eq!(e.key, format!("limits.{}", key.to_lowercase()));
        }
    }

    /// Listed devices × transfer.qps (+ the tcp fallback's endpoint) past what a peer accepts in
    /// one offer: the agent refuses to start, naming both numbers, instead of every connection
    /// being refused by the peer.
    #[test]
    fn qps_times_devices_past_a_peers_offer_limit_is_refused() {
        let devices = "rxe0,rxe1,rxe2,rxe3,rxe4,rxe5,rxe6,rxe7";
        let load = |pairs: &[(&str, &str)]| {
            let env: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            Config::load(None, env, &Overrides::default())
        };
        let e = load(&[("XFER_VERBS__DEVICES", devices), ("XFER_TRANSFER__QPS", "16")]).unwrap_err();
        assert_eq!(e.key, "transfer.qps");
        assert!(e.problem.contains("16 QPs × 8 devices = 128 endpoints") && e.problem.contains("at most 64"), "{e}");
        assert!(load(&[("XFER_VERBS__DEVICES", devices), ("XFER_TRANSFER__QPS", "8")]).is_ok());
        let e = load(&[("XFER_VERBS__DEVICES", devices), ("XFER_TRANSFER__QPS", "8"), ("XFER_TRANSFER__FALLBACK", "tcp")]).unwrap_err();
        assert!(e.problem.contains("+ 1 for the tcp fallback = 65"), "{e}");
        // A tcp agent offers no device QPs; `auto` is checked once the devices are open.
        assert!(load(&[("XFER_VERBS__DEVICES", devices), ("XFER_TRANSFER__QPS", "16"), ("XFER_FABRIC", "tcp")]).is_ok());
        let c = load(&[("XFER_TRANSFER__QPS", "16")]).unwrap();
        assert!(c.check_endpoints(4).is_ok());
        assert_eq!(c.check_endpoints(5).unwrap_err().key, "transfer.qps");
    }

    #[test]
    fn invalid_values_name_the_key() {
        let env = vec![("XFER_TRANSFER__CHUNK_SIZE".to_string(), "lots".to_string())];
        let e = Config::load(None, env, &Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("chunk_size"), "{e}");
        let env = vec![("XFER_VERBS__RETRY_CNT".to_string(), "7".to_string())];
        let e = Config::load(None, env, &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "verbs.retry_cnt");
        for v in ["1KiB", "1GiB"] {
            let env = vec![("XFER_VERBS__MAX_READ_WR".to_string(), v.to_string())];
            let e = Config::load(None, env, &Overrides::default()).unwrap_err();
            assert_eq!(e.key, "verbs.max_read_wr", "{v}");
        }
        let env = vec![("XFER_VERBS__MAX_READ_WR".to_string(), "256KiB".to_string())];
        assert_eq!(Config::load(None, env, &Overrides::default()).unwrap().verbs.max_read_wr, ByteSize(256 << 10));
        assert_eq!(
            Config::load(None, vec![], &Overrides::default()).unwrap().verbs_options().max_rd_atomic,
            0,
            "default: the device's maximum"
        );
        let env = vec![("XFER_VERBS__MAX_RD_ATOMIC".to_string(), "8".to_string())];
        assert_eq!(Config::load(None, env, &Overrides::default()).unwrap().verbs_options().max_rd_atomic, 8);
        let env = vec![("XFER_VERBS__PREBUILT".to_string(), "17".to_string())];
        let e = Config::load(None, env, &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "verbs.prebuilt");
        for (v, want) in [("0", 0), ("16", 16)] {
            let env = vec![("XFER_VERBS__PREBUILT".to_string(), v.to_string())];
            assert_eq!(Config::load(None, env, &Overrides::default()).unwrap().verbs_options().prebuilt, want);
        }
    }

    #[test]
    fn verbs_devices_parse_from_env_and_file_and_refuse_device_with_them() {
        let load = |pairs: &[(&str, &str)]| {
            Config::load(None, pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>(), &Overrides::default())
        };
        let c = load(&[]).unwrap();
        assert!(c.verbs.devices.is_empty(), "default: auto");
        assert_eq!(c.verbs_options().devices, None);
        assert!(c.to_toml().contains("devices = \"auto\""), "{}", c.to_toml());
        assert_eq!(load(&[("XFER_VERBS__DEVICES", "auto")]).unwrap().verbs_options().devices, None);
        let o = load(&[("XFER_VERBS__DEVICES", "rxe0, rxe2:1:3")]).unwrap().verbs_options();
        let names: Vec<String> = o.devices.unwrap().iter().map(ToString::to_string).collect();
        assert_eq!(names, vec!["rxe0", "rxe2:1:3"]);
        let e = load(&[("XFER_VERBS__DEVICES", "rxe0,rxe2:0")]).unwrap_err();
        assert_eq!(e.key, "verbs.devices[1]");
        let e = load(&[("XFER_VERBS__DEVICES", "rxe0,rxe0")]).unwrap_err();
        assert_eq!(e.key, "verbs.devices");
        let e = load(&[("XFER_VERBS__DEVICES", "rxe0,rxe2"), ("XFER_VERBS__DEVICE", "rxe1")]).unwrap_err();
        assert_eq!(e.key, "verbs.devices");
        assert!(e.to_string().contains("both verbs.device (rxe1) and verbs.devices (rxe0,rxe2)"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("agent.toml");
        std::fs::write(&file, "[verbs]\ndevices = [\"mlx5_0\", \"mlx5_1:1\"]\n").unwrap();
        let c = Config::load(Some(&file), Vec::<(String, String)>::new(), &Overrides::default()).unwrap();
        assert_eq!(c.verbs.devices, vec!["mlx5_0", "mlx5_1:1"]);
        assert_eq!(c.verbs_options().devices.unwrap()[1].port, Some(1));
    }

    #[test]
    fn regions_keys() {
        let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let c = Config::load(None, env(&[]), &Overrides::default()).unwrap();
        assert_eq!(c.regions.shm_mode, FileMode(0o600));
        assert_eq!(c.regions.effective_file_roots(std::path::Path::new("/s")), vec![PathBuf::from("/s/files")]);
        assert_eq!(c.regions.shm_gid().unwrap(), None);
        let c = Config::load(
            None,
            env(&[("XFER_REGIONS__FILE_ROOTS", "/data/a,/data/b"), ("XFER_REGIONS__SHM_MODE", "0660"), ("XFER_REGIONS__SHM_GROUP", "0")]),
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.regions.file_roots, vec![PathBuf::from("/data/a"), PathBuf::from("/data/b")]);
        assert_eq!(c.regions.shm_mode, FileMode(0o660));
        assert_eq!(c.regions.shm_gid().unwrap(), Some(0));
        assert!(c.to_toml().contains("shm_mode = \"0660\""), "{}", c.to_toml());
        let e = Config::load(None, env(&[("XFER_REGIONS__FILE_ROOTS", "relative/dir")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "regions.file_roots[0]");
        let e = Config::load(None, env(&[("XFER_REGIONS__SHM_MODE", "4755")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "regions.shm_mode");
        let e = Config::load(None, env(&[("XFER_REGIONS__SHM_GROUP", "no-such-group-xfer")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "regions.shm_group");
        // (gid_t)-1 would be chown's "no change": refused, not silently ignored.
        let e = Config::load(None, env(&[("XFER_REGIONS__SHM_GROUP", "4294967295")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "regions.shm_group");
    }

    #[test]
    fn tls_requires_all_three_files() {
        let dir = tempfile::tempdir().unwrap();
        let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let c = Config::load(None, env(&[]), &Overrides::default()).unwrap();
        assert!(c.insecure, "plaintext stays the default");
        let e = Config::load(None, env(&[("XFER_INSECURE", "false")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "tls.cert");
        let f = |n: &str| {
            let p = dir.path().join(n);
            std::fs::write(&p, "x").unwrap();
            p.display().to_string()
        };
        let (cert, key) = (f("a.crt"), f("a.key"));
        let e = Config::load(
            None,
            env(&[("XFER_INSECURE", "false"), ("XFER_TLS__CERT", &cert), ("XFER_TLS__KEY", &key), ("XFER_TLS__CA", "/nonexistent/ca.crt")]),
            &Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(e.key, "tls.ca");
        assert!(e.to_string().contains("/nonexistent/ca.crt"), "{e}");
        let ca = f("ca.crt");
        let c = Config::load(
            None,
            env(&[("XFER_INSECURE", "false"), ("XFER_TLS__CERT", &cert), ("XFER_TLS__KEY", &key), ("XFER_TLS__CA", &ca)]),
            &Overrides::default(),
        )
        .unwrap();
        assert!(!c.insecure);
    }
}
