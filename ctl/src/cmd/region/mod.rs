//! `xferctl region create|list|show|delete`.

pub mod create;
pub mod delete;
pub mod list;
pub mod show;

use clap::Subcommand;

use crate::Ctx;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a region (anonymous memory, a mapped file or a POSIX shm object).
    Create(create::Opt),
    /// List regions, optionally filtered by labels.
    List(list::Opt),
    /// Show one region.
    Show(show::Opt),
    /// Delete a region (revokes its grants).
    Delete(delete::Opt),
}

pub async fn run(command: Command, ctx: &Ctx) -> anyhow::Result<()> {
    match command {
        Command::Create(opt) => create::run(opt, ctx).await,
        Command::List(opt) => list::run(opt, ctx).await,
        Command::Show(opt) => show::run(opt, ctx).await,
        Command::Delete(opt) => delete::run(opt, ctx).await,
    }
}

/// Parses a `key=value` label or selector term.
pub fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("invalid label {s:?}: expected key=value")),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_label;

    #[test]
    fn labels() {
        assert_eq!(parse_label("a=b"), Ok(("a".into(), "b".into())));
        assert_eq!(parse_label("a="), Ok(("a".into(), String::new())));
        assert_eq!(parse_label("k=v=w"), Ok(("k".into(), "v=w".into())));
        assert!(parse_label("novalue").is_err());
        assert!(parse_label("=v").is_err());
    }
}
