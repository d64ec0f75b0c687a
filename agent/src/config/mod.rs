//! Agent configuration: built-in defaults < config file (TOML or YAML, `--config`) < environment
//! (`XFER_` prefix, `__` between nested keys, e.g. `XFER_TRANSFER__CHUNK_SIZE=4MiB`) < flags.
//!
//! Everything is parsed into validated types (sizes like `4MiB`, durations like `30s`); an
//! invalid value is a [`ConfigError`] naming the key, which the binary reports with exit code 64.
//!
//! [`Config`] (`root.rs`) holds the top-level keys and one struct per section (`sections.rs`,
//! `verbs.rs`, `limits.rs`, `regions.rs`); `load.rs` layers the sources and refuses unknown keys,
//! `validate.rs` and `bounds.rs` check what the types cannot.

mod bounds;
mod error;
mod limits;
mod load;
mod perms;
mod regions;
mod root;
mod sections;
mod validate;
mod verbs;

pub use error::ConfigError;
pub use limits::LimitsConfig;
pub use load::Overrides;
pub use perms::FileMode;
pub use regions::RegionsConfig;
pub use root::Config;
pub use sections::{FabricChoice, Fallback, GrantsConfig, LogConfig, LogFormat, ShutdownConfig, TlsConfig, TransferConfig};
pub use verbs::VerbsConfig;

/// Sizes (`4KiB`, `1.5GiB`, `16Gi`) and durations (`30s`) in the grammar xferctl's flags use too.
pub use xfer_common::{parse_size, ByteSize, HumanDuration};
pub use xfer_fabric::identity::{DnsRole, RoleName};
