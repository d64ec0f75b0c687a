//! `xferctl get [AGENT:]NAME[@OFFSET] [--len SIZE] FILE`: read a region range with `ReadRegion`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::ProgressBar;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::client::Client;
use crate::progress::byte_bar;
use crate::target::{parse_location, Location};
use crate::units::{self, parse_size};
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Source: [AGENT:]REGION[@OFFSET].
    #[arg(value_parser = parse_location, value_name = "[AGENT:]NAME[@OFFSET]")]
    pub source: Location,
    /// Bytes to read (default: to the end of the region).
    #[arg(long, value_parser = parse_size)]
    pub len: Option<u64>,
    /// Output file (`-` = stdout).
    pub file: PathBuf,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let agent = opt.source.agent_or(&ctx.agent).to_string();
    let client = ctx.connect(&agent).await?;
    let region = opt.source.region.as_str();
    let offset = opt.source.offset;
    let len = match opt.len {
        Some(len) => len,
        None => {
            let r = client.region(region).await.with_context(|| format!("getting region {region:?}"))?;
            r.length
                .checked_sub(offset)
                .with_context(|| format!("offset {offset} is beyond the end of region {region:?} ({} bytes)", r.length))?
        }
    };
    let to_stdout = opt.file.as_os_str() == "-";
    let display = opt.file.display().to_string();
    let started = Instant::now();
    let read = if to_stdout {
        read_region(&client, region, offset, len, tokio::io::stdout(), None).await?
    } else {
        let file = tokio::fs::File::create(&opt.file).await.with_context(|| format!("creating {display}"))?;
        read_region(&client, region, offset, len, file, byte_bar(len, true)).await.with_context(|| format!("writing {display}"))?
    };
    let secs = started.elapsed().as_secs_f64();
    if ctx.json && !to_stdout {
        ctx.print_json(&serde_json::json!({
            "region": region,
            "offset": offset,
            "bytes": read,
            "seconds": secs,
            "gib_per_s": units::gib_per_s(read, secs),
        }))
    } else if to_stdout {
        // stdout carries the data: the summary goes to stderr.
        eprintln!("got {}", units::rate_summary(read, secs));
        Ok(())
    } else {
        ctx.print(&format!("got {}\n", units::rate_summary(read, secs)))
    }
}

/// Reads `len` bytes of `region` at `offset` into `out` (the client checks that the agent's
/// pieces are contiguous and complete). Returns the bytes written to `out`.
pub async fn read_region<W>(
    client: &Client,
    region: &str,
    offset: u64,
    len: u64,
    mut out: W,
    bar: Option<ProgressBar>,
) -> anyhow::Result<u64>
where
    W: AsyncWrite + Unpin,
{
    let mut reader = client.read(region, offset, len).await.with_context(|| format!("reading region {region:?}"))?;
    while let Some(piece) = reader.next().await.with_context(|| format!("reading region {region:?}"))? {
        out.write_all(&piece).await.context("writing output")?;
        if let Some(b) = &bar {
            b.set_position(reader.done());
        }
    }
    out.flush().await.context("writing output")?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(reader.done())
}
