//! `xferctl put FILE [AGENT:]NAME[@OFFSET]`: stream a file into a region with `WriteRegion`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::ProgressBar;
use tokio::io::AsyncRead;

use crate::client::Client;
use crate::progress::byte_bar;
use crate::target::{parse_location, Location};
use crate::units;
use crate::Ctx;

/// Data bytes per `WriteRegion` message.
pub const CHUNK: usize = 1 << 20;

#[derive(Debug, Args)]
pub struct Opt {
    /// File to upload (`-` = stdin).
    pub file: PathBuf,
    /// Destination: [AGENT:]REGION[@OFFSET].
    #[arg(value_parser = parse_location, value_name = "[AGENT:]NAME[@OFFSET]")]
    pub dest: Location,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let agent = opt.dest.agent_or(&ctx.agent).to_string();
    let client = ctx.connect(&agent).await?;
    let started = Instant::now();
    let display = opt.file.display().to_string();
    let written = if opt.file.as_os_str() == "-" {
        write_region(&client, &opt.dest.region, opt.dest.offset, tokio::io::stdin(), None).await
    } else {
        let file = tokio::fs::File::open(&opt.file).await.with_context(|| format!("opening {display}"))?;
        let len = file.metadata().await.with_context(|| format!("reading metadata of {display}"))?.len();
        // Checked before the first byte is sent: a file that does not fit must leave the region
        // as it was, not holding the file's first bytes.
        let region = client.region(&opt.dest.region).await.with_context(|| format!("getting region {:?}", opt.dest.region))?;
        check_fits(&display, len, &opt.dest.region, region.length, opt.dest.offset)?;
        write_region(&client, &opt.dest.region, opt.dest.offset, file, byte_bar(len, true)).await
    }
    .with_context(|| format!("writing {display} to region {:?}", opt.dest.region))?;
    let secs = started.elapsed().as_secs_f64();
    if ctx.json {
        ctx.print_json(&serde_json::json!({
            "region": opt.dest.region,
            "offset": crate::view::u64s(opt.dest.offset),
            "bytes": crate::view::u64s(written),
            "seconds": secs,
            "gib_per_s": units::gib_per_s(written, secs),
        }))
    } else {
        ctx.print(&format!("put {}\n", units::rate_summary(written, secs)))
    }
}

/// Refuses (INVALID_ARGUMENT, nothing written) a `len`-byte file that does not fit in a
/// `region_len`-byte region at `offset`.
pub fn check_fits(file: &str, len: u64, region: &str, region_len: u64, offset: u64) -> anyhow::Result<()> {
    let room = region_len.saturating_sub(offset);
    if offset > region_len || len > room {
        return Err(xfer_client::Error::InvalidArgument(format!(
            "{file} is {len} bytes but region {region:?} has {room} bytes from offset {offset} ({region_len} bytes in all); nothing was written"
        ))
        .into());
    }
    Ok(())
}

/// Streams everything `reader` yields into `region` at `offset` (through
/// [`Client::put_reader`]), advancing `bar` as the bytes are read. Returns the bytes written.
pub async fn write_region<R>(client: &Client, region: &str, offset: u64, reader: R, bar: Option<ProgressBar>) -> anyhow::Result<u64>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let written = match &bar {
        Some(b) => client.put_reader(region, offset, b.wrap_async_read(reader)).await,
        None => client.put_reader(region, offset, reader).await,
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    written.context("WriteRegion")
}
