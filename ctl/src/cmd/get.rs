//! `xferctl get [AGENT:]NAME[@OFFSET] [--len SIZE] FILE`: read a region range with `ReadRegion`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::ProgressBar;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use xfer_proto::v1::{GetRegionRequest, ReadRegionRequest};

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
    let mut client = ctx.connect(&agent).await?;
    let region = opt.source.region.as_str();
    let offset = opt.source.offset;
    let len = match opt.len {
        Some(len) => len,
        None => {
            let r = client
                .get_region(GetRegionRequest {
                    name: region.to_string(),
                })
                .await
                .with_context(|| format!("getting region {region:?}"))?
                .into_inner();
            r.length.checked_sub(offset).with_context(|| {
                format!(
                    "offset {offset} is beyond the end of region {region:?} ({} bytes)",
                    r.length
                )
            })?
        }
    };
    let to_stdout = opt.file.as_os_str() == "-";
    let display = opt.file.display().to_string();
    let started = Instant::now();
    let read = if to_stdout {
        read_region(&mut client, region, offset, len, tokio::io::stdout(), None).await?
    } else {
        let file = tokio::fs::File::create(&opt.file)
            .await
            .with_context(|| format!("creating {display}"))?;
        read_region(&mut client, region, offset, len, file, byte_bar(len, true))
            .await
            .with_context(|| format!("writing {display}"))?
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

/// Reads `len` bytes of `region` at `offset` into `out`, checking that the agent's chunks are
/// contiguous and complete. Returns the bytes written to `out`.
pub async fn read_region<W>(
    client: &mut Client,
    region: &str,
    offset: u64,
    len: u64,
    mut out: W,
    bar: Option<ProgressBar>,
) -> anyhow::Result<u64>
where
    W: AsyncWrite + Unpin,
{
    let mut stream = client
        .read_region(ReadRegionRequest {
            region: region.to_string(),
            offset,
            length: len,
        })
        .await
        .with_context(|| format!("reading region {region:?}"))?
        .into_inner();
    let mut done: u64 = 0;
    while let Some(msg) = stream
        .message()
        .await
        .with_context(|| format!("reading region {region:?}"))?
    {
        // The offset is absolute in the region; tolerate agents that send it relative to the
        // start of the read.
        let expected = offset + done;
        if msg.offset != expected && msg.offset != done {
            anyhow::bail!(
                "the agent sent data for offset {} where {expected} was expected",
                msg.offset
            );
        }
        out.write_all(&msg.data).await.context("writing output")?;
        done += msg.data.len() as u64;
        if let Some(b) = &bar {
            b.set_position(done);
        }
        if done > len {
            anyhow::bail!("the agent sent {done} bytes, more than the {len} asked for");
        }
    }
    out.flush().await.context("writing output")?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if done != len {
        anyhow::bail!("short read: the agent sent {done} of {len} bytes");
    }
    Ok(done)
}

/// Reads a range into memory (used by `demo` to compare bytes).
pub async fn read_to_vec(
    client: &mut Client,
    region: &str,
    offset: u64,
    len: u64,
) -> anyhow::Result<Vec<u8>> {
    let capacity = usize::try_from(len).context("range too large to hold in memory")?;
    let mut buf = Vec::with_capacity(capacity);
    read_region(client, region, offset, len, &mut buf, None).await?;
    Ok(buf)
}
