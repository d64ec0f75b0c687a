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
    // The range is checked before the output is touched: a read past the region's end must not
    // create (or truncate) the output file.
    let r = client.region(region).await.with_context(|| format!("getting region {region:?}"))?;
    let len = check_range(region, r.length, offset, opt.len)?;
    let to_stdout = opt.file.as_os_str() == "-";
    let display = opt.file.display().to_string();
    let started = Instant::now();
    let read = if to_stdout {
        read_region(&client, region, offset, len, tokio::io::stdout(), None).await?
    } else {
        read_to_file(&client, region, offset, len, &opt.file).await.with_context(|| format!("writing {display}"))?
    };
    let secs = started.elapsed().as_secs_f64();
    if ctx.json && !to_stdout {
        ctx.print_json(&serde_json::json!({
            "region": region,
            "offset": crate::view::u64s(offset),
            "bytes": crate::view::u64s(read),
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

/// The bytes to read from `offset` of a `region_len`-byte region: `len`, or the rest when
/// `None`; a range past the end is refused (INVALID_ARGUMENT).
pub fn check_range(region: &str, region_len: u64, offset: u64, len: Option<u64>) -> anyhow::Result<u64> {
    let invalid = |m: String| anyhow::Error::new(xfer_client::Error::InvalidArgument(m));
    let rest = region_len
        .checked_sub(offset)
        .ok_or_else(|| invalid(format!("offset {offset} is beyond the end of region {region:?} ({region_len} bytes)")))?;
    match len {
        None => Ok(rest),
        Some(0) => Err(invalid("--len 0: nothing to read (leave --len out to read to the end of the region)".into())),
        Some(n) if n > rest => Err(invalid(format!(
            "--len {n} from offset {offset} runs past the end of region {region:?} ({region_len} bytes; {rest} from that offset)"
        ))),
        Some(n) => Ok(n),
    }
}

/// Reads the range into `path`, created only once the agent has answered with the first piece
/// (a refused read leaves no file behind); a file this call created is removed if the read
/// fails later.
async fn read_to_file(client: &Client, region: &str, offset: u64, len: u64, path: &std::path::Path) -> anyhow::Result<u64> {
    let mut reader = client.read(region, offset, len).await.with_context(|| format!("reading region {region:?}"))?;
    let first = reader.next().await.with_context(|| format!("reading region {region:?}"))?;
    let existed = tokio::fs::symlink_metadata(path).await.is_ok();
    let file = tokio::fs::File::create(path).await.context("creating the output file")?;
    let bar = byte_bar(len, true);
    let r = copy_pieces(&mut reader, first, file, bar.as_ref(), region).await;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if r.is_err() && !existed {
        let _ = tokio::fs::remove_file(path).await;
    }
    r.map(|()| reader.done())
}

/// Writes `first` and every later piece of `reader` to `out`.
async fn copy_pieces<W: AsyncWrite + Unpin>(
    reader: &mut xfer_client::RegionReader,
    first: Option<Vec<u8>>,
    mut out: W,
    bar: Option<&ProgressBar>,
    region: &str,
) -> anyhow::Result<()> {
    let mut piece = first;
    while let Some(p) = piece {
        out.write_all(&p).await.context("writing output")?;
        if let Some(b) = bar {
            b.set_position(reader.done());
        }
        piece = reader.next().await.with_context(|| format!("reading region {region:?}"))?;
    }
    out.flush().await.context("writing output")
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
