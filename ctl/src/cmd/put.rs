//! `xferctl put FILE [AGENT:]NAME[@OFFSET]`: stream a file into a region with `WriteRegion`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::ProgressBar;
use tokio::io::{AsyncRead, AsyncReadExt};
use xfer_proto::v1::WriteRegionRequest;

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
    let mut client = ctx.connect(&agent).await?;
    let started = Instant::now();
    let display = opt.file.display().to_string();
    let written = if opt.file.as_os_str() == "-" {
        write_region(
            &mut client,
            &opt.dest.region,
            opt.dest.offset,
            tokio::io::stdin(),
            None,
        )
        .await
    } else {
        let file = tokio::fs::File::open(&opt.file)
            .await
            .with_context(|| format!("opening {display}"))?;
        let len = file
            .metadata()
            .await
            .with_context(|| format!("reading metadata of {display}"))?
            .len();
        write_region(
            &mut client,
            &opt.dest.region,
            opt.dest.offset,
            file,
            byte_bar(len, true),
        )
        .await
    }
    .with_context(|| format!("writing {display} to region {:?}", opt.dest.region))?;
    let secs = started.elapsed().as_secs_f64();
    if ctx.json {
        ctx.print_json(&serde_json::json!({
            "region": opt.dest.region,
            "offset": opt.dest.offset,
            "bytes": written,
            "seconds": secs,
            "gib_per_s": units::gib_per_s(written, secs),
        }))
    } else {
        ctx.print(&format!("put {}\n", units::rate_summary(written, secs)))
    }
}

/// Streams everything `reader` yields into `region` at `offset`, in [`CHUNK`]-byte messages.
/// Returns the bytes the agent reports written.
pub async fn write_region<R>(
    client: &mut Client,
    region: &str,
    offset: u64,
    reader: R,
    bar: Option<ProgressBar>,
) -> anyhow::Result<u64>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    // A read error cannot travel through the request stream (its items are messages), so the
    // stream stops early and leaves the error here for us to report after the call.
    let read_error: Arc<Mutex<Option<std::io::Error>>> = Arc::default();
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    struct State<R> {
        reader: R,
        first: Option<(String, u64)>,
        finished: bool,
        error: Arc<Mutex<Option<std::io::Error>>>,
        sent: Arc<std::sync::atomic::AtomicU64>,
        bar: Option<ProgressBar>,
    }
    let state = State {
        reader,
        first: Some((region.to_string(), offset)),
        finished: false,
        error: read_error.clone(),
        sent: sent.clone(),
        bar: bar.clone(),
    };
    let stream = futures::stream::unfold(state, |mut st| async move {
        if st.finished {
            return None;
        }
        let mut data = vec![0u8; CHUNK];
        let mut filled = 0;
        while filled < CHUNK {
            match st.reader.read(&mut data[filled..]).await {
                Ok(0) => {
                    st.finished = true;
                    break;
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if let Ok(mut slot) = st.error.lock() {
                        *slot = Some(e);
                    }
                    return None;
                }
            }
        }
        data.truncate(filled);
        if filled == 0 && st.first.is_none() {
            return None;
        }
        let (region, offset) = st.first.take().unwrap_or_default();
        st.sent
            .fetch_add(filled as u64, std::sync::atomic::Ordering::Relaxed);
        if let Some(b) = &st.bar {
            b.inc(filled as u64);
        }
        Some((
            WriteRegionRequest {
                region,
                offset,
                data,
            },
            st,
        ))
    });
    let result = client.write_region(stream).await;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let taken = read_error.lock().ok().and_then(|mut slot| slot.take());
    if let Some(e) = taken {
        return Err(anyhow::Error::new(e).context(format!(
            "read failed after {} bytes were sent",
            sent.load(std::sync::atomic::Ordering::Relaxed)
        )));
    }
    let written = result.context("WriteRegion")?.into_inner().bytes_written;
    let sent = sent.load(std::sync::atomic::Ordering::Relaxed);
    if written != sent {
        anyhow::bail!("the agent wrote {written} bytes but {sent} were sent");
    }
    Ok(written)
}
