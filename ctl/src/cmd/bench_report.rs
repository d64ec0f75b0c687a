//! `xferctl bench`'s report: each row's bandwidth as a ratio of its baseline (one run, or the
//! median of rounds with their range), the perftest-style and KV tables, and the JSON document.
use serde_json::{json, Value};
use xfer_client::{BenchResult, Op, TcpBaseline};

use crate::units::{format_size_compact, gbit_per_s};
use crate::view::Table;

/// A baseline's median run and which baseline it is.
pub type Base<'a> = Option<(&'a TcpBaseline, &'static str)>;

/// A row's bandwidth as a ratio of its baseline: with rounds, the median of the rounds' ratios
/// (each fabric run against the baseline run just before it) and their range; the baseline's
/// median over the row's rounds; and the best fabric round over the best baseline round. On a
/// shared host, interference only slows a run: the best of each side is the run least disturbed,
/// so their ratio moves less with the noise than any one round's does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ratio {
    median: f64,
    min: f64,
    max: f64,
    rounds: usize,
    base_gbit: f64,
    best: f64,
}

impl Ratio {
    /// One fabric run against one baseline figure (`None` when the baseline moved nothing).
    pub fn single(row: &BenchResult, base_gbit: f64) -> Option<Ratio> {
        (base_gbit > 0.0).then(|| {
            let r = row_gbit(row) / base_gbit;
            Ratio { median: r, min: r, max: r, rounds: 1, base_gbit, best: r }
        })
    }

    /// The rounds' (fabric, baseline) pairs; pairs whose baseline moved nothing are left out.
    pub fn of_rounds(pairs: &[(f64, f64)]) -> Option<Ratio> {
        let usable = || pairs.iter().filter(|(_, b)| *b > 0.0);
        let mut ratios: Vec<f64> = usable().map(|(f, b)| f / b).collect();
        let mut bases: Vec<f64> = usable().map(|(_, b)| *b).collect();
        let best_fabric = usable().map(|(f, _)| *f).fold(0.0, f64::max);
        ratios.sort_by(f64::total_cmp);
        bases.sort_by(f64::total_cmp);
        Some(Ratio {
            median: median_of(&ratios)?,
            min: *ratios.first()?,
            max: *ratios.last()?,
            rounds: ratios.len(),
            base_gbit: median_of(&bases)?,
            best: best_fabric / *bases.last()?,
        })
    }
}

/// The median of sorted figures (the mean of the middle two for an even count).
fn median_of(sorted: &[f64]) -> Option<f64> {
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// The baseline is measured this many times, interleaved with the sizes (before, between,
/// after), and the median run is reported, so a noisy moment skews neither side alone.
pub const BASELINE_RUNS: usize = 3;

/// Bandwidth in Gb/s, from the agent's figure or recomputed from bytes and seconds.
pub fn row_gbit(r: &BenchResult) -> f64 {
    if r.gbit_per_s > 0.0 {
        r.gbit_per_s
    } else {
        gbit_per_s(r.bytes, r.seconds)
    }
}

/// A table whose rows are the `lead` cells, the bandwidth (Gb/s and GiB/s), the `tail` cells
/// and, with a baseline, the bandwidth as a ratio of it (`BW/tcp` or `BW/tls`; `-` when the
/// baseline moved nothing), with the rounds' range when a row ran more than once.
fn bandwidth_table(
    lead: &[&str],
    tail: &[&str],
    rows: &[(BenchResult, Option<Ratio>)],
    baseline: Base<'_>,
    cells: impl Fn(&BenchResult) -> (Vec<String>, Vec<String>),
) -> String {
    let mut header: Vec<&str> = lead.to_vec();
    header.extend(["BW Gb/s", "BW GiB/s"]);
    header.extend(tail);
    let label = baseline.map(|(_, kind)| format!("BW/{kind}"));
    let ranged = rows.iter().any(|(_, r)| r.is_some_and(|r| r.rounds > 1));
    if let Some(label) = &label {
        header.push(label);
        if ranged {
            header.extend(["range", "best/best"]);
        }
    }
    let mut t = Table::new(&header);
    for (r, ratio) in rows {
        let gbit = row_gbit(r);
        let (mut row, after) = cells(r);
        row.push(format!("{gbit:.2}"));
        row.push(format!("{:.3}", gbit * 1e9 / 8.0 / (1u64 << 30) as f64));
        row.extend(after);
        if baseline.is_some() {
            row.push(ratio.map(|q| format!("{:.2}", q.median)).unwrap_or_else(|| "-".into()));
            if ranged {
                row.push(ratio.map(|q| format!("{:.2}-{:.2}", q.min, q.max)).unwrap_or_else(|| "-".into()));
                row.push(ratio.map(|q| format!("{:.2}", q.best)).unwrap_or_else(|| "-".into()));
            }
        }
        t.row(row);
    }
    t.render()
}

/// The baseline's footer line: which, and its median run.
fn baseline_footer(baseline: Base<'_>, rows: &[(BenchResult, Option<Ratio>)]) -> String {
    let Some((b, kind)) = baseline else { return String::new() };
    let rounds = rows.iter().filter_map(|(_, r)| *r).map(|r| r.rounds).max().unwrap_or(1);
    let how = if rounds > 1 {
        format!(
            "{rounds} rounds per row, each the baseline and then the fabric; ratio: the rounds' median; \
             best/best: the best fabric round over the best baseline round; median run of all"
        )
    } else {
        format!("median of {BASELINE_RUNS} runs")
    };
    format!("# {} baseline ({how}): {} bytes in {:.3} s = {:.2} Gb/s\n", kind, b.bytes, b.seconds, b.gbit_per_s)
}

/// The perftest-style table.
pub fn render(rows: &[(BenchResult, Option<Ratio>)], baseline: Base<'_>) -> String {
    let mut out = bandwidth_table(&["#bytes", "iters"], &["lat avg us", "lat p50 us", "lat p99 us"], rows, baseline, |r| {
        (
            vec![r.size.to_string(), r.iters.to_string()],
            // No latency phase (`--latency-iters 0`): no figures, rather than zeros.
            [r.lat_avg_us, r.lat_p50_us, r.lat_p99_us]
                .iter()
                .map(|us| if r.lat_iters == 0 { "-".to_string() } else { format!("{us:.2}") })
                .collect(),
        )
    });
    out.push_str(&baseline_footer(baseline, rows));
    out
}

/// The KV-pattern table: one row per run.
pub fn render_kv(rows: &[(BenchResult, Option<Ratio>)], baseline: Base<'_>) -> String {
    let channel = rows.iter().any(|(r, _)| r.channel);
    let mut tail = vec!["batch p50 ms", "batch p99 ms", "submit p50 us", "prep ns/seg"];
    if channel {
        tail.extend(["repost ns/seg", "open ms"]);
    }
    let mut out = bandwidth_table(&["pattern", "batches"], &tail, rows, baseline, |r| {
        let mut after = vec![
            format!("{:.2}", r.lat_p50_us / 1e3),
            format!("{:.2}", r.lat_p99_us / 1e3),
            format!("{:.0}", r.submit_p50_us),
            format!("{:.0}", r.prep_ns_per_segment),
        ];
        if channel {
            after.extend([format!("{:.1}", r.repost_ns_per_segment), format!("{:.2}", r.channel_open_us / 1e3)]);
        }
        let name = if r.channel { "kv channel" } else { "kv" };
        (vec![format!("{name} {}x{}", r.blocks, format_size_compact(r.size)), r.iters.to_string()], after)
    });
    out.push_str(&baseline_footer(baseline, rows));
    out
}

pub fn json_doc(agent: &str, peer: &str, op: Op, rows: &[(BenchResult, Option<Ratio>)], baseline: Base<'_>) -> Value {
    json!({
        "agent": agent,
        "peer": peer,
        "op": op.to_string(),
        "rows": rows.iter().map(|(r, ratio)| {
            let gbit = row_gbit(r);
            json!({
                "size": r.size,
                "iters": r.iters,
                "bytes": r.bytes,
                "seconds": r.seconds,
                "gbit_per_s": gbit,
                "gib_per_s": gbit * 1e9 / 8.0 / (1u64 << 30) as f64,
                "lat_avg_us": r.lat_avg_us,
                "lat_p50_us": r.lat_p50_us,
                "lat_p99_us": r.lat_p99_us,
                "lat_iters": r.lat_iters,
                "fabric": r.fabric.to_string(),
                "ratio_to_baseline": ratio.map(|q| q.median),
                "ratio_min": ratio.map(|q| q.min),
                "ratio_max": ratio.map(|q| q.max),
                "ratio_best": ratio.map(|q| q.best),
                "rounds": ratio.map_or(1, |q| q.rounds),
                "baseline_gbit_per_s": ratio.map(|q| q.base_gbit),
                "pattern": if r.blocks > 0 { "kv" } else { "messages" },
                "blocks": r.blocks,
                "submit_p50_us": r.submit_p50_us,
                "prep_ns_per_segment": r.prep_ns_per_segment,
                "channel": r.channel,
                "repost_ns_per_segment": r.repost_ns_per_segment,
                "channel_open_us": r.channel_open_us,
            })
        }).collect::<Vec<_>>(),
        "baseline": baseline.map(|(b, kind)| json!({
            "kind": kind,
            "bytes": b.bytes,
            "seconds": b.seconds,
            "gbit_per_s": b.gbit_per_s,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::{json_doc, render, Ratio};
    use xfer_client::{BenchResult, Op, TcpBaseline};

    #[test]
    fn table_with_ratio() {
        let rows = [BenchResult {
            size: 1 << 20,
            iters: 100,
            bytes: 100 << 20,
            seconds: 1.0,
            gbit_per_s: 0.0, // recomputed from bytes/seconds
            lat_avg_us: 10.0,
            lat_p50_us: 9.5,
            lat_p99_us: 20.0,
            lat_iters: 100,
            ..Default::default()
        }];
        let base = TcpBaseline { bytes: 1, seconds: 1.0, gbit_per_s: 0.8388608 };
        let rows = rows.map(|r| (r.clone(), Ratio::single(&r, base.gbit_per_s)));
        let text = render(&rows, Some((&base, "tcp")));
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
        assert_eq!(header, ["#bytes", "iters", "BW Gb/s", "BW GiB/s", "lat avg us", "lat p50 us", "lat p99 us", "BW/tcp"]);
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        // 100 MiB in 1 s = 0.8388608 Gb/s = 0.098 GiB/s; ratio 1.00.
        assert_eq!(row, ["1048576", "100", "0.84", "0.098", "10.00", "9.50", "20.00", "1.00"]);
        assert!(text.contains("# tcp baseline"));
        // A run without a latency phase (`--latency-iters 0`) shows none, not zeros.
        let alone = [(BenchResult { lat_iters: 0, lat_avg_us: 0.0, lat_p50_us: 0.0, lat_p99_us: 0.0, ..rows[0].0.clone() }, None)];
        let row: Vec<String> = render(&alone, None).lines().nth(1).unwrap().split_whitespace().map(str::to_string).collect();
        assert_eq!(row, ["1048576", "100", "0.84", "0.098", "-", "-", "-"]);
        let doc = json_doc("a", "b", Op::Write, &rows, Some((&base, "tcp")));
        assert_eq!(doc["rows"][0]["size"], 1 << 20);
        assert!((doc["rows"][0]["ratio_to_baseline"].as_f64().unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(doc["baseline"]["kind"], "tcp");
        assert_eq!(doc["rows"][0]["rounds"], 1);
    }

    /// Rounds: the ratio is the median of the rounds' own ratios (not of the medians of each
    /// side), the range their extremes, and a round whose baseline moved nothing is left out.
    #[test]
    fn rounds_report_the_median_ratio_and_its_range() {
        let q = Ratio::of_rounds(&[(9.0, 10.0), (12.0, 10.0), (5.0, 4.0), (3.0, 0.0)]).expect("three usable rounds");
        assert_eq!(q.rounds, 3);
        assert!((q.median - 1.2).abs() < 1e-9, "{q:?}");
        assert!((q.min - 0.9).abs() < 1e-9 && (q.max - 1.25).abs() < 1e-9, "{q:?}");
        assert!((q.base_gbit - 10.0).abs() < 1e-9, "{q:?}");
        let even = Ratio::of_rounds(&[(1.0, 1.0), (2.0, 1.0)]).expect("two rounds");
        assert!((even.median - 1.5).abs() < 1e-9, "{even:?}");
        assert_eq!(Ratio::of_rounds(&[(1.0, 0.0)]), None);
        assert_eq!(Ratio::of_rounds(&[]), None);

        let row = BenchResult { size: 4096, iters: 10, bytes: 40960, seconds: 1.0, ..Default::default() };
        let base = TcpBaseline { bytes: 1, seconds: 1.0, gbit_per_s: 10.0 };
        let text = render(&[(row.clone(), Some(q))], Some((&base, "tls")));
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
        assert_eq!(header[header.len() - 3..], ["BW/tls", "range", "best/best"]);
        let cells: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(cells[cells.len() - 3..], ["1.20", "0.90-1.25", "1.20"]);
        assert!(text.contains("3 rounds per row"), "{text}");
        let doc = json_doc("a", "b", Op::Write, &[(row, Some(q))], Some((&base, "tls")));
        assert_eq!(doc["rows"][0]["rounds"], 3);
        assert_eq!(doc["rows"][0]["ratio_min"], 0.9);
        assert_eq!(doc["rows"][0]["baseline_gbit_per_s"], 10.0);
        assert_eq!(doc["rows"][0]["ratio_best"], 1.2);
    }

    /// The best fabric round over the best baseline round, whichever rounds they are: one
    /// disturbed round on either side moves it less than it moves that round's own ratio.
    #[test]
    fn best_over_best_pairs_the_least_disturbed_run_of_each_side() {
        let q = Ratio::of_rounds(&[(10.0, 8.0), (6.0, 12.0), (9.0, 9.0), (20.0, 0.0)]).expect("three usable rounds");
        assert!((q.median - 1.0).abs() < 1e-9, "{q:?}");
        assert!((q.min - 0.5).abs() < 1e-9 && (q.max - 1.25).abs() < 1e-9, "{q:?}");
        // 10 / 12: the round whose baseline moved nothing counts on neither side.
        assert!((q.best - 10.0 / 12.0).abs() < 1e-9, "{q:?}");
        let one = BenchResult { size: 4096, iters: 10, bytes: 40960, seconds: 1.0, ..Default::default() };
        let single = Ratio::single(&one, 0.65536).expect("a baseline");
        assert!((single.best - single.median).abs() < 1e-9, "one run: best is the ratio itself: {single:?}");
    }
}
