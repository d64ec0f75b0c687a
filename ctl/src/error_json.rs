//! A failure rendered for `--json`: one JSON object on stderr, so a script that asked for JSON
//! parses errors too.

use serde_json::json;

/// A failure under `--json`, for stderr, on one line: the message (the text form's line), the
/// gRPC status name when an agent's status (or a transport failure) caused it, and the exit code.
pub fn error_json(exit_code: u8, line: &str) -> String {
    // The text form ends with ` (STATUS_NAME)` when a status caused the failure.
    let status = line
        .strip_suffix(')')
        .and_then(|l| l.rsplit_once(" ("))
        .map(|(_, name)| name)
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_uppercase() || c == '_'));
    let v = json!({"error": {"message": line, "status": status, "exit_code": exit_code}});
    v.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn errors_as_json_name_their_status_and_exit_code() {
        let v: Value = serde_json::from_str(&error_json(4, "bad range (INVALID_ARGUMENT)")).unwrap();
        assert_eq!(v["error"]["status"], "INVALID_ARGUMENT");
        assert_eq!(v["error"]["exit_code"], 4);
        assert_eq!(v["error"]["message"], "bad range (INVALID_ARGUMENT)");
        let v: Value = serde_json::from_str(&error_json(1, "no agent (see the log)")).unwrap();
        assert_eq!(v["error"]["status"], Value::Null);
        assert!(!error_json(1, "two\nlines\u{1b}[31m").contains('\n'), "one line, escaped");
    }
}
