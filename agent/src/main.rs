//! `xfer-agent`: flags → config → [`xfer_agent::app::run`]. Exit 64 on bad configuration.
#![forbid(unsafe_code)]
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;
use xfer_agent::config::{Config, FabricChoice, LogFormat, Overrides};

#[derive(Parser, Debug)]
#[command(name = "xfer-agent", version, about = "xfer node agent: RDMA (or TCP) one-sided transfers controlled over gRPC")]
struct Flags {
    /// Config file (TOML or YAML). Env vars XFER_* and these flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Node name (default: host name)
    #[arg(long)]
    node_name: Option<String>,
    /// gRPC listen address [default: 127.0.0.1:7470]. Plaintext (insecure = true) is refused on
    /// non-loopback addresses unless allow_plaintext_network = true.
    #[arg(long)]
    listen: Option<String>,
    /// Prometheus metrics listen address [default: 0.0.0.0:9470]
    #[arg(long)]
    metrics_listen: Option<String>,
    /// TCP-fabric data listen address [default: the --listen host, a port the OS picks]
    #[arg(long)]
    data_listen: Option<String>,
    /// Plaintext gRPC health-only listener for probes [default: off]
    #[arg(long)]
    health_listen: Option<String>,
    /// Write the bound addresses as JSON {grpc, data, metrics, health} to this file once serving
    /// (listeners may use port 0) [default: off]
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Data plane [default: auto]
    #[arg(long, value_enum)]
    fabric: Option<FabricChoice>,
    /// Where the region catalog lives [default: /var/lib/xfer]
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// RDMA device (default: the first with an active port)
    #[arg(long)]
    device: Option<String>,
    /// Log format [default: text]
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
    /// Print the effective configuration and exit
    #[arg(long)]
    print_config: bool,
}

fn main() -> ExitCode {
    let flags = Flags::parse();
    let overrides = Overrides {
        node_name: flags.node_name.clone(),
        listen: flags.listen.clone(),
        metrics_listen: flags.metrics_listen.clone(),
        data_listen: flags.data_listen.clone(),
        health_listen: flags.health_listen.clone(),
        ready_file: flags.ready_file.clone(),
        fabric: flags.fabric,
        state_dir: flags.state_dir.clone(),
        log_format: flags.log_format,
        device: flags.device.clone(),
    };
    let cfg = match Config::load(flags.config.as_deref(), std::env::vars(), &overrides) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("xfer-agent: invalid configuration: {e}");
            return ExitCode::from(64);
        }
    };
    if flags.print_config {
        println!("{}", cfg.to_toml());
        return ExitCode::SUCCESS;
    }
    init_logging(&cfg);
    match start(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once: every start error carries its cause in its own message.
            eprintln!("xfer-agent: {e:#}");
            if e.downcast_ref::<xfer_agent::app::StartError>().is_some_and(|s| s.is_bad_configuration()) {
                ExitCode::from(64)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn init_logging(cfg: &Config) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cfg.log.level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cfg.log.format {
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(true).init(),
        LogFormat::Text => builder.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init(),
    }
}

fn start(cfg: Config) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the tokio runtime")?;
    rt.block_on(async move {
        let shutdown = CancellationToken::new();
        let s = shutdown.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            s.cancel();
        });
        Ok(xfer_agent::app::run(cfg, shutdown).await?)
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        // Without signal handlers the agent still stops on Ctrl-C via the default action.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
