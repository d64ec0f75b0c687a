//! Who may see what the agent creates: file modes written as octal strings and group settings
//! resolved to gids (the unix socket, shm objects).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::{bad, ConfigError};

/// A file mode (permission bits) that reads `"0600"` (octal, as a string) or an integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMode(pub u32);

impl Serialize for FileMode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:04o}", self.0))
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u32),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(FileMode(n)),
            Raw::S(s) => u32::from_str_radix(s.trim().trim_start_matches("0o"), 8)
                .map(FileMode)
                .map_err(|_| serde::de::Error::custom(format!("invalid file mode {s:?}: expected octal like \"0600\""))),
        }
    }
}

/// A group setting as a gid: a number, or a group name looked up in the group database.
pub(super) fn group_gid(key: &str, group: Option<&str>) -> Result<Option<u32>, ConfigError> {
    match group.map(str::trim).filter(|g| !g.is_empty()) {
        None => Ok(None),
        Some(g) => match g.parse::<u32>() {
            // (gid_t)-1 is chown's "leave the group as it is": the group asked for would silently
            // not be given.
            Ok(u32::MAX) => Err(bad(key, format!("{g} is not a group id (chown reads it as \"no change\")"))),
            Ok(n) => Ok(Some(n)),
            Err(_) => match nix::unistd::Group::from_name(g) {
                Ok(Some(grp)) => Ok(Some(grp.gid.as_raw())),
                Ok(None) => Err(bad(key, format!("no group named {g:?}"))),
                Err(e) => Err(bad(key, format!("looking up group {g:?}: {e}"))),
            },
        },
    }
}
