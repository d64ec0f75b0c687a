//! One module per subcommand. Each has an `Opt` (clap derive) and
//! `async fn run(opt, ctx) -> anyhow::Result<()>`.

pub mod bench;
pub mod bench_notify;
pub mod bench_report;
pub mod completions;
pub mod connect;
pub mod cp;
pub mod demo;
pub mod doctor;
pub mod doctor_peer;
pub mod get;
pub mod info;
pub mod peers;
pub mod put;
pub mod region;
pub mod transfer;
pub mod version;
pub mod watch_inbound;

use clap::Subcommand;

use crate::Ctx;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the agent's node, version, fabric, devices, limits and uptime.
    Info(info::Opt),
    /// Check the agent and (when it is local) this host for RDMA readiness; with `--peer B`,
    /// every local × remote device pair, probed.
    Doctor(doctor::Opt),
    /// Create, list, show and delete regions.
    #[command(subcommand)]
    Region(region::Command),
    /// Load a file into a region through the control plane.
    Put(put::Opt),
    /// Read a region range into a file (or stdout).
    Get(get::Opt),
    /// Copy a range between regions, on the same or different agents.
    Cp(cp::Opt),
    /// List, follow, show and cancel transfers.
    #[command(subcommand)]
    Transfer(transfer::Command),
    /// Print notifications of batches that landed in this agent's regions (`cp --notify`).
    WatchInbound(watch_inbound::Opt),
    /// Pre-connect the agent to a peer agent.
    Connect(connect::Opt),
    /// List the agent's peer connections.
    Peers(peers::Opt),
    /// Bandwidth and latency between two agents across message sizes (perftest-style).
    Bench(bench::Opt),
    /// Start two agents on loopback, copy data between them and verify it.
    Demo(demo::Opt),
    /// Print a shell completion script.
    Completions(completions::Opt),
    /// Print this client's version and the agent's.
    Version(version::Opt),
}

pub async fn run(command: Command, ctx: &Ctx) -> anyhow::Result<()> {
    match command {
        Command::Info(opt) => info::run(opt, ctx).await,
        Command::Doctor(opt) => doctor::run(opt, ctx).await,
        Command::Region(cmd) => region::run(cmd, ctx).await,
        Command::Put(opt) => put::run(opt, ctx).await,
        Command::Get(opt) => get::run(opt, ctx).await,
        Command::Cp(opt) => cp::run(opt, ctx).await,
        Command::Transfer(cmd) => transfer::run(cmd, ctx).await,
        Command::WatchInbound(opt) => watch_inbound::run(opt, ctx).await,
        Command::Connect(opt) => connect::run(opt, ctx).await,
        Command::Peers(opt) => peers::run(opt, ctx).await,
        Command::Bench(opt) => bench::run(opt, ctx).await,
        Command::Demo(opt) => demo::run(opt, ctx).await,
        Command::Completions(opt) => completions::run(opt, ctx).await,
        Command::Version(opt) => version::run(opt, ctx).await,
    }
}
