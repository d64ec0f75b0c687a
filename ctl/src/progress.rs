//! Following a transfer to its end (`cp`, `transfer watch`, `demo`) with an optional progress bar,
//! and turning its terminal state into success or a typed [`Failure`].

use std::io::IsTerminal;
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use xfer_client::{State, Transfer};

use crate::client::Client;
use crate::error::Failure;
use crate::units;

/// A byte progress bar on stderr, or nothing when stderr is not a terminal.
pub fn byte_bar(len: u64, enabled: bool) -> Option<ProgressBar> {
    if !enabled || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    Some(bar)
}

/// Streams `WatchTransfer` until the transfer reaches a terminal state and returns that record.
/// If the stream ends early, falls back to one `GetTransfer`.
pub async fn watch(client: &Client, id: &str, show_bar: bool) -> anyhow::Result<Transfer> {
    watch_each(client, id, show_bar, |_| Ok(())).await
}

/// [`watch`], calling `each` with every record the agent streams (each change).
pub async fn watch_each(
    client: &Client,
    id: &str,
    show_bar: bool,
    mut each: impl FnMut(&Transfer) -> anyhow::Result<()>,
) -> anyhow::Result<Transfer> {
    let mut stream = client.watch(id).await.with_context(|| format!("watching transfer {id}"))?;
    let mut bar: Option<ProgressBar> = None;
    let mut last: Option<Transfer> = None;
    while let Some(t) = stream.next().await.with_context(|| format!("watching transfer {id}"))? {
        if bar.is_none() && !t.state.is_terminal() {
            bar = byte_bar(t.length, show_bar);
            if let Some(b) = &bar {
                // Rate and ETA count from here: bytes done before the watch began are not part
                // of what this watch saw move (they made a late `transfer watch` show 423 MiB/s
                // for a 64 MiB/s transfer).
                b.set_position(t.bytes_done);
                b.reset_eta();
            }
        }
        if let Some(b) = &bar {
            if t.length != 0 {
                b.set_length(t.length);
            }
            b.set_position(t.bytes_done);
            b.set_message(t.state.as_str());
        }
        each(&t)?;
        let done = t.state.is_terminal();
        last = Some(t);
        if done {
            break;
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    match last {
        Some(t) if t.state.is_terminal() => Ok(t),
        other => {
            let t = client.get_transfer(id).await.with_context(|| format!("getting transfer {id}"))?;
            if t.state.is_terminal() {
                Ok(t)
            } else {
                let state = other.map(|t| t.state.to_string()).unwrap_or_default();
                anyhow::bail!("the agent ended the watch of transfer {id} before it finished (last state {state})")
            }
        }
    }
}

/// One line per change for a log or a pipe: state, bytes done of the length, and the error once
/// there is one.
pub fn change_line(t: &Transfer) -> String {
    let mut line = format!("{} {} {}/{} bytes", t.id, t.state, t.bytes_done, t.length);
    if !t.error.is_empty() {
        line.push_str(&format!(" error: {}", t.error));
    }
    line.push('\n');
    line
}

/// Cancels transfer `id` and follows it until it stops; its final record (CANCELLED, or the state
/// it reached first when it was already finishing).
pub async fn cancel_and_wait(client: &Client, id: &str) -> anyhow::Result<Transfer> {
    client.cancel(id).await.with_context(|| format!("cancelling transfer {id}"))?;
    watch(client, id, false).await
}

/// `Ok` for SUCCEEDED (and verified when `want_verify`), the matching [`Failure`] otherwise.
pub fn outcome(t: &Transfer, want_verify: bool) -> Result<(), Failure> {
    match t.state {
        State::Succeeded => {
            if want_verify && !t.verified {
                Err(Failure::VerifyMismatch(format!("transfer {} succeeded but the agent did not report it verified", t.id)))
            } else {
                Ok(())
            }
        }
        State::Cancelled => Err(Failure::TransferCancelled { id: t.id.clone(), error: t.error.clone() }),
        _ => Err(Failure::TransferFailed { id: t.id.clone(), error: t.error.clone(), error_code: t.error_code.clone() }),
    }
}

/// `copied N bytes in S s (X GiB/s)`; uses the agent's elapsed time, or `fallback` (local wall
/// clock since submission) when the agent reported none.
pub fn copied_line(t: &Transfer, fallback: Instant) -> String {
    let secs = if t.elapsed_seconds > 0.0 { t.elapsed_seconds } else { fallback.elapsed().as_secs_f64() };
    let mut line = format!("copied {}", units::rate_summary(t.bytes_done, secs));
    if t.verified {
        line.push_str(", verified");
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(state: State) -> Transfer {
        Transfer { id: "t".into(), state, error: "boom".into(), error_code: "RETRY_EXC_ERR".into(), ..Default::default() }
    }

    #[test]
    fn outcomes() {
        assert!(outcome(&t(State::Succeeded), false).is_ok());
        assert!(matches!(outcome(&t(State::Succeeded), true), Err(Failure::VerifyMismatch(_))));
        let mut verified = t(State::Succeeded);
        verified.verified = true;
        assert!(outcome(&verified, true).is_ok());
        assert!(matches!(
            outcome(&t(State::Failed), false),
            Err(Failure::TransferFailed { ref error_code, .. }) if error_code == "RETRY_EXC_ERR"
        ));
        assert!(matches!(outcome(&t(State::Cancelled), false), Err(Failure::TransferCancelled { .. })));
    }

    #[test]
    fn copied_line_uses_agent_time() {
        let mut x = t(State::Succeeded);
        x.bytes_done = 1 << 30;
        x.elapsed_seconds = 0.5;
        assert_eq!(copied_line(&x, Instant::now()), "copied 1073741824 bytes in 0.500 s (2.000 GiB/s)");
    }
}
