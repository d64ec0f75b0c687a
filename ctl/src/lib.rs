//! `xferctl`: the command-line client of the xfer agent.
//!
//! It talks to an agent's public `xfer.v1.Agent` gRPC service (see `proto/xfer/v1/xfer.proto`) to
//! inspect a node, manage regions, load and read data, run and follow transfers between agents,
//! benchmark a link and run a self-contained two-agent demo.
//!
//! # Layout
//!
//! - `main.rs` — thin: calls [`main`].
//! - [`cmd`] — one module per subcommand, each with a clap `Opt` and
//!   `async fn run(opt, ctx) -> anyhow::Result<()>`; `region` and `transfer` have one module per
//!   sub-subcommand.
//! - [`error`] — the ONE place that turns failures (gRPC statuses, failed transfers, connection
//!   errors) into an exit code and a one-line message.
//! - [`error_json`] — a failure as one JSON object on stderr, under `--json`.
//! - [`client`] — connecting to an agent.
//! - [`progress`] — following a transfer with `WatchTransfer` and a progress bar.
//! - [`view`] — JSON views and text tables of the protobuf messages (prost types have no serde).
//! - [`segments`] — segment lists for `cp --segments` (one `SRC DST LEN` per line, strided blocks).
//! - [`units`] — human sizes (`4KiB`, `1.5GiB`) and durations (`30s`).
//! - [`target`] — agent addresses and `[AGENT:]REGION[@OFFSET]` locations.
//!
//! # Exit codes
//!
//! | code | meaning |
//! |-----:|---------|
//! | 0 | success |
//! | 1 | other error |
//! | 2 | usage error (clap) |
//! | 3 | `NOT_FOUND` |
//! | 4 | `INVALID_ARGUMENT` (and `OUT_OF_RANGE`) |
//! | 5 | `PERMISSION_DENIED` (and `UNAUTHENTICATED`) |
//! | 6 | `FAILED_PRECONDITION` (and `ABORTED`) |
//! | 7 | `RESOURCE_EXHAUSTED` |
//! | 8 | `UNAVAILABLE`, or the agent could not be reached (connection refused, timeout) |
//! | 9 | `DEADLINE_EXCEEDED` |
//! | 10 | transfer ended `FAILED` (its `error` and `error_code` are printed) |
//! | 11 | transfer ended `CANCELLED` (and the gRPC status `CANCELLED`) |
//! | 12 | verification mismatch (checksums or bytes differ; `--verify` not honoured) |
//! | 13 | `ALREADY_EXISTS` |
//!
//! On failure exactly one line `error: ...` goes to stderr, naming the gRPC status code where
//! there is one, e.g. `error: region "foo" not found (NOT_FOUND)`.
#![forbid(unsafe_code)]

pub mod client;
pub mod cmd;
pub mod diagnose;
pub mod error;
pub mod error_json;
pub mod progress;
pub mod segments;
pub mod target;
pub mod units;
pub mod view;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;

/// Command-line client for the xfer RDMA transfer agent.
#[derive(Debug, Parser)]
#[command(name = "xferctl", version, about, after_help = error::EXIT_CODES_HELP)]
pub struct Cli {
    /// Agent gRPC address: host, host:port or [v6]:port (port defaults to 7470).
    #[arg(
        long,
        global = true,
        env = "XFER_AGENT",
        default_value = target::DEFAULT_AGENT,
        value_parser = target::normalize_agent,
        value_name = "ADDR"
    )]
    pub agent: String,

    /// Print machine-readable JSON on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,

    /// Client certificate (PEM) for mTLS; needs --key and --ca. Without --cert/--key/--ca the
    /// connection is plaintext.
    #[arg(long, global = true, env = "XFER_CERT", value_name = "PEM", requires_all = ["key", "ca"])]
    pub cert: Option<PathBuf>,

    /// Private key (PEM) of --cert.
    #[arg(long, global = true, env = "XFER_KEY", value_name = "PEM", requires_all = ["cert", "ca"])]
    pub key: Option<PathBuf>,

    /// CA bundle (PEM) that the agent's certificate must chain to; turns TLS on.
    #[arg(long, global = true, env = "XFER_CA", value_name = "PEM")]
    pub ca: Option<PathBuf>,

    /// Name to verify the agent's certificate against (default: the host of the agent address).
    #[arg(long, global = true, env = "XFER_TLS_SERVER_NAME", value_name = "NAME")]
    pub tls_server_name: Option<String>,

    #[command(subcommand)]
    pub command: cmd::Command,
}

/// What every command gets besides its own options.
#[derive(Debug, Clone)]
pub struct Ctx {
    /// The normalised `--agent` address (`host:port`).
    pub agent: String,
    /// `--json` was given.
    pub json: bool,
    /// TLS files from `--cert/--key/--ca` (None = plaintext).
    pub tls: Option<client::TlsFiles>,
}

impl Ctx {
    /// A client for the `--agent` agent.
    pub async fn client(&self) -> anyhow::Result<client::Client> {
        self.connect(&self.agent).await
    }

    /// A client for the agent at `addr`, with the global TLS options.
    pub async fn connect(&self, addr: &str) -> anyhow::Result<client::Client> {
        client::connect_with(addr, self.tls.as_ref()).await
    }

    /// Writes `text` to stdout. A closed pipe (`xferctl region list | head -1`) is not an error.
    pub fn print(&self, text: &str) -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        // Everything printed here is text for a terminal (tables, details, JSON); bytes a user
        // asked for (`xferctl get -`) go to stdout elsewhere, unchanged.
        let text = view::terminal_safe(text);
        match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            other => other.context("writing to stdout"),
        }
    }

    /// Prints a JSON document (pretty, newline-terminated).
    pub fn print_json(&self, value: &serde_json::Value) -> anyhow::Result<()> {
        self.print(&view::json_text(value))
    }
}

/// Parses the command line, runs the command and maps the outcome to an exit code.
pub fn main() -> ExitCode {
    // Help, version and usage errors exit here: 0 for help/version, 2 for usage errors.
    let cli = Cli::parse();
    let tls = cli.ca.map(|ca| client::TlsFiles { cert: cli.cert, key: cli.key, ca, server_name: cli.tls_server_name });
    let (agent, wants_tls) = target::split_tls_scheme(&cli.agent);
    if wants_tls && tls.is_none() {
        eprintln!("error: --agent {} asks for TLS: give --ca (and --cert/--key for mTLS), or XFER_CA/XFER_CERT/XFER_KEY", cli.agent);
        return ExitCode::from(2);
    }
    let ctx = Ctx { agent: agent.to_string(), json: cli.json, tls };
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
        .and_then(|rt| rt.block_on(cmd::run(cli.command, &ctx)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let (code, line) = error::report(&err);
            if ctx.json {
                // A script that asked for JSON parses stderr too: one JSON object on one line.
                eprintln!("{}", error_json::error_json(code, &line));
            } else {
                eprintln!("error: {}", view::terminal_safe(&line));
            }
            ExitCode::from(code)
        }
    }
}
