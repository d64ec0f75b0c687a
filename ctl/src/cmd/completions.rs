//! `xferctl completions SHELL`: shell completion scripts (clap_complete).

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// The shell to generate completions for.
    pub shell: Shell,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let mut cmd = crate::Cli::command();
    let mut buf = Vec::new();
    clap_complete::generate(opt.shell, &mut cmd, "xferctl", &mut buf);
    ctx.print(&String::from_utf8_lossy(&buf))
}
