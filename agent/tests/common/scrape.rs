//! Reading an agent's metrics: one scrape of its metrics listener, the samples of a series in
//! it, and waits on a gauge.
use std::time::Duration;

use super::process::Agent;

/// `xfer_notify_markers_total{result}` of `a`.
pub fn notify_markers(a: &Agent, result: &str) -> f64 {
    labelled(&scrape(a), "xfer_notify_markers_total", &[("result", result)])
}

/// GET /metrics from the agent's metrics listener (a plain HTTP/1.0 request: the server closes
/// when done); the answer must be a 200.
pub fn scrape(a: &Agent) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", a.ports.metrics)).unwrap();
    s.set_read_timeout(Some(super::READ_GUARD)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200"), "metrics answered {out:.200}");
    out
}

/// Sum of the samples of `series` in a scrape: an exact name with `{labels}`, or a bare name
/// (its unlabelled sample and every labelled one); 0 when absent.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series || (!series.contains('{') && name.starts_with(&format!("{series}{{")))).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Sum of the samples of `name` carrying every one of `labels`, in whatever order the exporter
/// writes them (`metric` needs the exact series text).
pub fn labelled(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The value of the unlabelled gauge `name` in a scrape of `a` (0 if absent).
pub fn gauge(a: &Agent, name: &str) -> f64 {
    let prefix = format!("{name} ");
    scrape(a).lines().find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().parse().unwrap())).unwrap_or(0.0)
}

/// Waits until the unlabelled gauge `name` of `a` reads `want` (polled, at most 3000 times 20 ms
/// apart: a safety net against a hang; the wait is for the value).
pub async fn wait_gauge(a: &Agent, name: &str, want: f64) {
    for _ in 0..3000 {
        if gauge(a, name) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{name} never reached {want}: {}", scrape(a));
}
