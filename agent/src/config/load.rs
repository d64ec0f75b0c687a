//! Loading: built-in defaults < config file < `XFER_` environment < flags, layered through the
//! `config` crate; keys the configuration does not have are refused naming the closest known one;
//! and printing the effective configuration back as TOML.

use std::path::PathBuf;

use super::error::{bad, ConfigError};
use super::root::Config;
use super::sections::{FabricChoice, LogFormat};

/// Command-line values that override everything else (`None` = not given).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub node_name: Option<String>,
    pub listen: Option<String>,
    pub metrics_listen: Option<String>,
    pub data_listen: Option<String>,
    pub health_listen: Option<String>,
    pub ready_file: Option<PathBuf>,
    pub fabric: Option<FabricChoice>,
    pub state_dir: Option<PathBuf>,
    pub log_format: Option<LogFormat>,
    pub device: Option<String>,
}

impl Config {
    /// Layers defaults < file < environment (`env` pairs, normally `std::env::vars()`) < flags.
    pub fn load(
        file: Option<&std::path::Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &Overrides,
    ) -> Result<Config, ConfigError> {
        let defaults = ::config::Config::try_from(&Config::default()).map_err(|e| bad("defaults", e.to_string()))?;
        let mut b = ::config::Config::builder().add_source(defaults);
        if let Some(path) = file {
            if !path.exists() {
                return Err(bad("config", format!("file {} does not exist", path.display())));
            }
            b = b.add_source(::config::File::from(path));
        }
        // Nested variables (`XFER_SECTION__KEY`) must name a known key; a single-level `XFER_X` is
        // read only when X is a top-level key (others belong to other tools: xferctl's
        // XFER_AGENT/XFER_CERT, test harnesses), so the check below never sees them.
        let known = known_keys();
        let env: std::collections::HashMap<String, String> = env
            .into_iter()
            .filter(|(k, _)| match k.strip_prefix("XFER_") {
                Some(rest) => rest.contains("__") || known.contains(&rest.to_lowercase()),
                None => false,
            })
            .collect();
        let env_names: Vec<String> = env.keys().cloned().collect();
        b = b.add_source(::config::Environment::with_prefix("XFER").prefix_separator("_").separator("__").source(Some(env)));
        let set = |b: ::config::ConfigBuilder<::config::builder::DefaultState>, k: &str, v: Option<String>| match v {
            Some(v) => b.set_override(k, v).map_err(|e| bad(k, e.to_string())),
            None => Ok(b),
        };
        b = set(b, "node_name", flags.node_name.clone())?;
        b = set(b, "listen", flags.listen.clone())?;
        b = set(b, "metrics_listen", flags.metrics_listen.clone())?;
        b = set(b, "data_listen", flags.data_listen.clone())?;
        b = set(b, "health_listen", flags.health_listen.clone())?;
        b = set(b, "ready_file", flags.ready_file.as_ref().map(|p| p.display().to_string()))?;
        b = set(b, "fabric", flags.fabric.map(|f| format!("{f:?}").to_lowercase()))?;
        b = set(b, "state_dir", flags.state_dir.as_ref().map(|p| p.display().to_string()))?;
        b = set(b, "log.format", flags.log_format.map(|f| format!("{f:?}").to_lowercase()))?;
        b = set(b, "verbs.device", flags.device.clone())?;
        let built = b.build().map_err(config_error)?;
        // Unknown keys are errors, not silently ignored: `[limit]`, `chunksize` or
        // XFER_TRANFER__DEPTH would otherwise load and leave the defaults in force.
        let merged: serde_json::Value = built.clone().try_deserialize().map_err(config_error)?;
        if let Some(key) = unknown_keys(&merged, &known).into_iter().next() {
            let env_name = format!("XFER_{}", key.to_uppercase().replace('.', "__"));
            let from = if env_names.iter().any(|n| n == &env_name) {
                format!("environment variable {env_name}")
            } else {
                "the config file".to_string()
            };
            let hint = closest_key(&key, &known).map(|k| format!("; did you mean `{k}`?")).unwrap_or_default();
            return Err(bad(&key, format!("unknown key (from {from}){hint}")));
        }
        let mut cfg: Config = built.try_deserialize().map_err(config_error)?;
        if cfg.node_name.is_empty() {
            cfg.node_name = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "localhost".into());
        }
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn to_toml(&self) -> String {
        toml_like(self)
    }
}

/// Adds every key of `v` below `prefix` to `out`, as dotted paths, sections included.
fn key_paths(prefix: &str, v: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
    if let serde_json::Value::Object(m) = v {
        for (k, v) in m {
            let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
            key_paths(&path, v, out);
            out.insert(path);
        }
    }
}

/// Every key the configuration has, as dotted paths (`transfer.depth`), sections included.
fn known_keys() -> std::collections::BTreeSet<String> {
    // The defaults with every optional key set: keys that are `None` by default are skipped
    // when serializing (`skip_serializing_if`, for --print-config's TOML) and would look unknown.
    // A new optional key must be filled here too; the config tests set each of them.
    let mut every = Config::default();
    every.data_listen = Some(every.listen);
    every.health_listen = Some(every.listen);
    every.ready_file = Some(PathBuf::from("ready"));
    every.unix_listen = Some(PathBuf::from("agent.sock"));
    every.unix_group = Some(String::new());
    every.regions.shm_group = Some(String::new());
    every.regions.shm_owner = Some(String::new());
    let mut out = std::collections::BTreeSet::new();
    // Serializing plain structs, strings and numbers cannot fail; an empty set would only make
    // every key unknown, which the tests would show at once.
    if let Ok(v) = serde_json::to_value(every) {
        key_paths("", &v, &mut out);
    }
    out
}

/// Keys in `merged` that the configuration does not have. Values of known leaves (strings,
/// lists such as `tls.dns_roles`) are not looked into.
fn unknown_keys(merged: &serde_json::Value, known: &std::collections::BTreeSet<String>) -> Vec<String> {
    fn walk(prefix: &str, v: &serde_json::Value, known: &std::collections::BTreeSet<String>, out: &mut Vec<String>) {
        let serde_json::Value::Object(m) = v else { return };
        for (k, v) in m {
            let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
            match v {
                // An unknown table is reported by its keys (`tranfer.depth`, which names the
                // variable XFER_TRANFER__DEPTH and is closest to `transfer.depth`).
                serde_json::Value::Object(inner) if !known.contains(&path) && !inner.is_empty() => walk(&path, v, &Default::default(), out),
                _ if known.contains(&path) => walk(&path, v, known, out),
                _ => out.push(path),
            }
        }
    }
    let mut out = Vec::new();
    walk("", merged, known, &mut out);
    out
}

/// The known key closest to `key` (by the whole path or by its last part), if one is close.
fn closest_key(key: &str, known: &std::collections::BTreeSet<String>) -> Option<String> {
    let last = |s: &str| s.rsplit('.').next().unwrap_or(s).to_string();
    let (k_last, k_flat) = (last(key), key.replace('_', ""));
    known
        .iter()
        .map(|p| {
            let d = strsim::levenshtein(key, p)
                .min(strsim::levenshtein(&k_last, &last(p)))
                .min(strsim::levenshtein(&k_flat, &last(p).replace('_', "")));
            (d, p)
        })
        .filter(|(d, _)| *d <= 2.max(k_last.len() / 3))
        .min_by_key(|(d, p)| (*d, p.len()))
        .map(|(_, p)| p.clone())
}

fn config_error(e: ::config::ConfigError) -> ConfigError {
    use ::config::ConfigError as E;
    match e {
        E::Type { key: Some(ref key), .. } | E::At { key: Some(ref key), .. } => {
            let text = e.to_string();
            // The key is printed in front already.
            bad(key, text.split(" for key `").next().unwrap_or(&text))
        }
        E::Message(m) => {
            // serde messages look like "invalid size \"x\"... for key `transfer.chunk_size`"
            let key = m.split("for key `").nth(1).and_then(|r| r.split('`').next()).unwrap_or("config").to_string();
            // The key is printed in front already.
            let m = m.split(" for key `").next().unwrap_or(&m).to_string();
            bad(&key, m)
        }
        other => bad("config", other.to_string()),
    }
}

/// Effective configuration in the config file's own format (TOML), so it can be saved and reused.
/// `toml` is already in the tree through the `config` crate.
fn toml_like(c: &Config) -> String {
    let text = toml::to_string_pretty(c).unwrap_or_else(|e| format!("# cannot render configuration: {e}"));
    // TOML has no null: keys without a value are not serialized, so they are named in a comment
    // first (every key of the configuration appears, set or not).
    let mut present = std::collections::BTreeSet::new();
    if let Ok(v) = serde_json::to_value(c) {
        key_paths("", &v, &mut present);
    }
    let unset: Vec<String> = known_keys().difference(&present).cloned().collect();
    if unset.is_empty() {
        return text;
    }
    let mut out = String::from("# Unset (no value: set them in the file, with XFER_* or a flag):\n");
    for k in unset {
        out.push_str(&format!("#   {k}\n"));
    }
    out.push('\n');
    out + &text
}

#[cfg(test)]
mod tests {
    use super::super::{parse_size, ByteSize, Config, FabricChoice, Overrides};

    /// `--print-config` names every key: those without a value in a comment.
    #[test]
    fn print_config_names_unset_keys() {
        let text = Config::default().to_toml();
        for key in ["data_listen", "health_listen", "ready_file", "unix_listen", "unix_group", "regions.shm_group", "regions.shm_owner"] {
            assert!(text.lines().any(|l| l == format!("#   {key}")), "{key} missing:\n{text}");
        }
        assert!(text.contains("listen = \"127.0.0.1:7470\""), "{text}");
        let mut set = Config::default();
        set.data_listen = Some(set.listen);
        assert!(!set.to_toml().contains("#   data_listen"), "a set key is not listed as unset");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert_eq!(ByteSize(64 << 20).to_string(), "64MiB");
    }

    /// A key the configuration does not have is an error naming it, where it came from and the
    /// closest known key — never silently ignored with the default left in force.
    #[test]
    fn unknown_keys_are_refused_with_the_closest_known_key() {
        let dir = tempfile::tempdir().unwrap();
        let load_file = |text: &str| {
            let f = dir.path().join("agent.toml");
            std::fs::write(&f, text).unwrap();
            Config::load(Some(&f), Vec::new(), &Overrides::default())
        };
        for (text, key, closest) in [
            ("[limit]\nmax_regions = 3\n", "limit.max_regions", "limits.max_regions"),
            ("chunksize = \"1MiB\"\n", "chunksize", "transfer.chunk_size"),
            ("[transfer]\ndept = 3\n", "transfer.dept", "transfer.depth"),
            ("[verbs]\ngrantmode = \"mw\"\n", "verbs.grantmode", "verbs.grant_mode"),
        ] {
            let e = load_file(text).unwrap_err();
            assert_eq!(e.key, key, "{text}: {e}");
            assert!(e.problem.contains("the config file") && e.problem.contains(&format!("did you mean `{closest}`")), "{text}: {e}");
        }
        let env = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        let e = Config::load(None, env("XFER_TRANFER__DEPTH", "8"), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "tranfer.depth");
        assert!(e.problem.contains("environment variable XFER_TRANFER__DEPTH") && e.problem.contains("`transfer.depth`"), "{e}");
        // Nothing like a known key: no suggestion.
        let e = load_file("zzzzzzzzzz = 1\n").unwrap_err();
        assert!(!e.problem.contains("did you mean"), "{e}");
        // Single-level XFER_ variables that are not keys belong to other tools and are ignored.
        let others =
            vec![("XFER_AGENT".into(), "h:1".into()), ("XFER_CERT".into(), "c.pem".into()), ("XFER_RXE_A_DEV".into(), "rxe0".into())];
        assert!(Config::load(None, others, &Overrides::default()).is_ok());
        // Every optional key is known (they are skipped when None in --print-config).
        let f = dir.path().join("all.toml");
        std::fs::write(
            &f,
            "data_listen = \"127.0.0.1:0\"\nhealth_listen = \"127.0.0.1:0\"\nready_file = \"r.json\"\n[regions]\nshm_owner = \"\"\n",
        )
        .unwrap();
        Config::load(Some(&f), Vec::new(), &Overrides::default()).unwrap();
    }

    #[test]
    fn enum_values_are_refused_with_their_choices() {
        let env = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        let e = Config::load(None, env("XFER_FABRIC", "tpc"), &Overrides::default()).unwrap_err();
        assert_eq!((e.key.as_str(), e.problem.as_str()), ("fabric", "\"tpc\" is not one of: auto, tcp, verbs"));
        let e = Config::load(None, env("XFER_VERBS__GRANT_MODE", "window"), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "verbs.grant_mode");
        assert!(e.problem.contains("mr, mw, region"), "{e}");
        let e = Config::load(None, env("XFER_LOG__FORMAT", "yaml"), &Overrides::default()).unwrap_err();
        assert!(e.problem.contains("text, json"), "{e}");
        // Case does not matter, as before.
        assert_eq!(Config::load(None, env("XFER_FABRIC", "TCP"), &Overrides::default()).unwrap().fabric, FabricChoice::Tcp);
    }

    #[test]
    fn layering_defaults_file_env_flags() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "node_name = \"from-file\"\n[transfer]\nchunk_size = \"2MiB\"\ndepth = 4\n").unwrap();
        let env = vec![("XFER_TRANSFER__DEPTH".to_string(), "8".to_string())];
        let c = Config::load(Some(&f), env.clone(), &Overrides::default()).unwrap();
        assert_eq!(c.node_name, "from-file");
        assert_eq!(c.transfer.chunk_size, ByteSize(2 << 20));
        assert_eq!(c.transfer.depth, 8, "env beats file");
        assert_eq!(c.transfer.qps, 2, "default");
        let flags = Overrides { node_name: Some("from-flag".into()), ..Default::default() };
        let c = Config::load(Some(&f), env, &flags).unwrap();
        assert_eq!(c.node_name, "from-flag");
    }

    #[test]
    fn transfer_fallback_is_never_by_default_and_tcp_from_file_or_env() {
        use crate::config::Fallback;
        assert_eq!(Config::load(None, vec![], &Overrides::default()).unwrap().transfer.fallback, Fallback::Never);
        let env = vec![("XFER_TRANSFER__FALLBACK".to_string(), "tcp".to_string())];
        assert_eq!(Config::load(None, env, &Overrides::default()).unwrap().transfer.fallback, Fallback::Tcp);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "[transfer]\nfallback = \"tcp\"\n").unwrap();
        assert_eq!(Config::load(Some(&f), vec![], &Overrides::default()).unwrap().transfer.fallback, Fallback::Tcp);
        let env = vec![("XFER_TRANSFER__FALLBACK".to_string(), "rdma".to_string())];
        let e = Config::load(None, env, &Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("fallback") && e.problem.contains("never, tcp"), "{e}");
    }

    #[test]
    fn tls_kernel_is_off_by_default_and_auto_from_file_or_env() {
        use xfer_fabric::identity::tls::KernelTls;
        assert_eq!(Config::load(None, vec![], &Overrides::default()).unwrap().tls.kernel, KernelTls::Off);
        let env = vec![("XFER_TLS__KERNEL".to_string(), "auto".to_string())];
        assert_eq!(Config::load(None, env, &Overrides::default()).unwrap().tls.kernel, KernelTls::Auto);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "[tls]\nkernel = \"auto\"\n").unwrap();
        assert_eq!(Config::load(Some(&f), vec![], &Overrides::default()).unwrap().tls.kernel, KernelTls::Auto);
        let env = vec![("XFER_TLS__KERNEL".to_string(), "on".to_string())];
        let e = Config::load(None, env, &Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("kernel") && e.problem.contains("off, auto"), "{e}");
    }

    #[test]
    fn printed_config_loads_back_unchanged() {
        let c = Config::load(None, Vec::new(), &Overrides { node_name: Some("n1".into()), ..Default::default() }).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("printed.toml");
        std::fs::write(&f, c.to_toml()).unwrap();
        let back = Config::load(Some(&f), Vec::new(), &Overrides::default()).unwrap();
        assert_eq!(back.to_toml(), c.to_toml());
        assert!(c.to_toml().contains("chunk_size = \"1MiB\""), "{}", c.to_toml());
    }
}
