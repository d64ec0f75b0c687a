//! Region labels and label selectors, checked by Kubernetes' rules before they cost anything.
//!
//! Labels are shown to every client (`ListRegions`, `xferctl region show`) and written into the
//! catalog, so what one tenant puts there must be small and inert for the others: a key is
//! `[prefix/]name` with a DNS-subdomain prefix of at most 253 characters and a name of 1-63
//! characters of `[A-Za-z0-9._-]` that starts and ends alphanumeric; a value is 0-63 such
//! characters (starting and ending alphanumeric when not empty); a region has at most
//! [`MAX_LABELS`] labels and [`MAX_LABEL_BYTES`] bytes of keys and values in all.
//!
//! The bytes are bounded, not counted against `max_registered_bytes`: [`MAX_LABEL_BYTES`] is two
//! pages per region, negligible next to the region it describes, and it keeps a `ListRegions`
//! answer for the default 1,024 regions (with their names and paths) under the default 16 MiB
//! message size, which a per-byte count against gigabytes of registered memory would not.
//! No control character, escape sequence or non-ASCII byte can pass these rules.

use std::collections::BTreeMap;

/// Most labels one region may carry (and most terms one selector may have).
pub const MAX_LABELS: usize = 64;
/// Most bytes of label keys and values one region may carry in all.
pub const MAX_LABEL_BYTES: usize = 8 << 10;
/// Longest key prefix (a DNS subdomain).
pub const MAX_PREFIX_LEN: usize = 253;
/// Longest key name and longest value.
pub const MAX_NAME_LEN: usize = 63;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelError {
    #[error("{n} labels; a region has at most {MAX_LABELS}")]
    TooMany { n: usize },
    #[error("labels of {bytes} bytes in all; a region has at most {MAX_LABEL_BYTES}")]
    TooLarge { bytes: usize },
    /// `key` and `value` are [`shown`]: escaped and cut short.
    #[error("label key \"{key}\": {why}")]
    Key { key: String, why: &'static str },
    #[error("label \"{key}\": value \"{value}\": {why}")]
    Value { key: String, value: String, why: &'static str },
}

/// A key or value in error messages: its start, and only printable ASCII (the rest escaped),
/// so a refusal never echoes megabytes or escape sequences back.
fn shown(s: &str) -> String {
    let mut out: String = s.chars().take(80).flat_map(char::escape_default).collect();
    if s.chars().count() > 80 {
        out.push_str("...");
    }
    out
}

fn name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
}

/// A name part or a non-empty value: 1-63 of `[A-Za-z0-9._-]`, alphanumeric at both ends.
fn check_name(s: &str) -> Result<(), &'static str> {
    let b = s.as_bytes();
    if b.is_empty() {
        return Err("the name part is empty");
    }
    if b.len() > MAX_NAME_LEN {
        return Err("longer than 63 characters");
    }
    if !b.iter().all(|&c| name_char(c)) {
        return Err("only A-Z a-z 0-9 . _ - are allowed");
    }
    if !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric() {
        return Err("must start and end with a letter or digit");
    }
    Ok(())
}

/// A DNS subdomain (RFC 1123): lower-case labels of `[a-z0-9-]`, alphanumeric at both ends,
/// 1-63 characters each, dot-separated, 253 in all.
fn check_prefix(p: &str) -> Result<(), &'static str> {
    if p.is_empty() || p.len() > MAX_PREFIX_LEN {
        return Err("the prefix must be a DNS subdomain of 1-253 characters");
    }
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        !b.is_empty()
            && b.len() <= 63
            && b.iter().all(|&c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-'
    };
    if p.split('.').all(label_ok) {
        Ok(())
    } else {
        Err("the prefix must be a DNS subdomain (lower-case a-z 0-9 - in dot-separated parts)")
    }
}

/// One key: `[prefix/]name`.
pub fn check_key(key: &str) -> Result<(), LabelError> {
    let bad = |why| LabelError::Key { key: shown(key), why };
    match key.split_once('/') {
        Some((prefix, name)) => {
            check_prefix(prefix).map_err(bad)?;
            check_name(name).map_err(bad)
        }
        None => check_name(key).map_err(bad),
    }
}

/// One value (empty allowed).
pub fn check_value(key: &str, value: &str) -> Result<(), LabelError> {
    if value.is_empty() {
        return Ok(());
    }
    check_name(value).map_err(|why| LabelError::Value { key: shown(key), value: shown(value), why })
}

/// A whole label set (a region's labels, or a selector's terms): the count, each key and value
/// (the first offender named), then the total size.
pub fn check(labels: &BTreeMap<String, String>) -> Result<(), LabelError> {
    if labels.len() > MAX_LABELS {
        return Err(LabelError::TooMany { n: labels.len() });
    }
    for (k, v) in labels {
        check_key(k)?;
        check_value(k, v)?;
    }
    let bytes: usize = labels.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_LABEL_BYTES {
        return Err(LabelError::TooLarge { bytes });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(k: &str, v: &str) -> BTreeMap<String, String> {
        [(k.to_string(), v.to_string())].into()
    }

    #[test]
    fn kubernetes_examples_pass() {
        for (k, v) in [
            ("app", "web"),
            ("app.kubernetes.io/name", "my-app_1.2"),
            ("x", ""),
            ("a", "A"),
            ("xfer.io/scratch", "bench"),
            (
                &format!("{}/{}", ["a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61)].join("."), "n".repeat(63)),
                &"v".repeat(63),
            ),
        ] {
            assert_eq!(check(&one(k, v)), Ok(()), "{k}={v}");
        }
    }

    #[test]
    fn every_rule_refuses_naming_the_key() {
        let cases: &[(&str, &str, &str)] = &[
            ("", "v", "empty"),
            ("-a", "v", "start and end"),
            ("a-", "v", "start and end"),
            ("a b", "v", "only"),
            ("a\u{1b}[31m", "v", "only"),
            ("é", "v", "only"),
            ("Example.com/a", "v", "DNS subdomain"),
            ("/a", "v", "DNS subdomain"),
            ("ex..com/a", "v", "DNS subdomain"),
            ("-ex.com/a", "v", "DNS subdomain"),
            ("ex.com/", "v", "empty"),
            ("ex.com/a/b", "v", "only"),
            ("k", "-v", "start and end"),
            ("k", "v\n", "only"),
            ("k", "\u{1b}]0;owned\u{7}", "only"),
            ("k", "a\u{202e}b", "only"),
        ];
        for (k, v, why) in cases {
            let e = check(&one(k, v)).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(why), "{k:?}={v:?}: {text}");
            assert!(!text.contains('\u{1b}') && !text.contains('\u{202e}'), "the refusal echoes no control characters: {text:?}");
            assert!(text.contains(&shown(k)), "the refusal names the key: {text}");
        }
        assert!(check(&one(&"k".repeat(64), "v")).unwrap_err().to_string().contains("63"));
        assert!(check(&one("k", &"v".repeat(64))).unwrap_err().to_string().contains("63"));
        assert!(check(&one(&format!("{}/k", "a".repeat(254)), "v")).unwrap_err().to_string().contains("253"));
    }

    #[test]
    fn count_and_total_size_are_bounded() {
        let many: BTreeMap<String, String> = (0..=MAX_LABELS).map(|i| (format!("k{i}"), "v".into())).collect();
        assert_eq!(check(&many), Err(LabelError::TooMany { n: MAX_LABELS + 1 }));
        let max: BTreeMap<String, String> = (0..MAX_LABELS).map(|i| (format!("k{i}"), "v".into())).collect();
        assert_eq!(check(&max), Ok(()));
        // 64 labels of the longest key and value are valid one by one, but too large together.
        let big: BTreeMap<String, String> = (0..MAX_LABELS).map(|i| (format!("{}.ex.com/{}", i, "n".repeat(63)), "v".repeat(63))).collect();
        assert!(matches!(check(&big), Err(LabelError::TooLarge { .. })));
    }

    #[test]
    fn a_long_key_is_not_echoed_whole() {
        let e = check(&one(&"a ".repeat(1 << 20), "v")).unwrap_err().to_string();
        assert!(e.len() < 400 && e.contains("longer than 63"), "{} bytes: {e}", e.len());
    }
}
