//! `xferctl transfer list|watch|show|cancel`.

pub mod cancel;
pub mod list;
pub mod show;
pub mod watch;

use clap::Subcommand;

use crate::Ctx;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the agent's transfers (initiated and inbound).
    List(list::Opt),
    /// Follow a transfer until it ends, with a progress bar on a terminal.
    Watch(watch::Opt),
    /// Show one transfer.
    Show(show::Opt),
    /// Cancel a transfer.
    Cancel(cancel::Opt),
}

pub async fn run(command: Command, ctx: &Ctx) -> anyhow::Result<()> {
    match command {
        Command::List(opt) => list::run(opt, ctx).await,
        Command::Watch(opt) => watch::run(opt, ctx).await,
        Command::Show(opt) => show::run(opt, ctx).await,
        Command::Cancel(opt) => cancel::run(opt, ctx).await,
    }
}
