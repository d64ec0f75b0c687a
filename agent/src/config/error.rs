//! The one error of configuration: which key is wrong and why (the binary exits 64 with it).

#[derive(Debug, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct ConfigError {
    pub key: String,
    pub problem: String,
}

/// A [`ConfigError`] for `key`.
pub(super) fn bad(key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError { key: key.to_string(), problem: problem.into() }
}
