//! Presentation of the client crate's types: times, JSON views and plain-text tables.
//!
//! Every JSON document xferctl prints is built here with `serde_json::json!`, in one place, with
//! stable field names (snake_case, enums as short lower-case strings, times as RFC 3339,
//! durations in seconds). Integers follow protobuf's JSON mapping, as the API's own JSON does:
//! 64-bit ones (offsets, lengths, byte counts, checksums, addresses) are strings, since jq and
//! JavaScript round a JSON number above 2^53, and 32-bit ones are numbers; a value that is absent
//! (a checksum nobody computed) is null, never "0". Benchmark reports are measurements, not API
//! objects: their sizes and counts stay numbers.

use std::time::{Duration, SystemTime};

use serde_json::{json, Value};
use xfer_client::{AgentInfo, Device, Gid, Notification, Peer, Region, Transfer};

/// RFC 3339 (seconds precision) or `None` when unset.
pub fn rfc3339(t: &Option<SystemTime>) -> Option<String> {
    t.map(|t| humantime::format_rfc3339_seconds(t).to_string())
}

/// A duration rounded to whole seconds for humans (`1h 2m 3s`); sub-second values keep millis.
pub fn human_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        humantime::format_duration(Duration::from_millis(d.as_millis() as u64)).to_string()
    } else {
        humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
    }
}

/// `memlock` limits are `u64::MAX` when unlimited.
pub fn limit_bytes(v: u64) -> String {
    if v == u64::MAX {
        "unlimited".into()
    } else {
        crate::units::format_bytes(v)
    }
}

/// Formats a 16-byte GID as an IPv6 address (IPv4-mapped GIDs show the IPv4 address too).
pub fn gid_text(raw: &[u8]) -> String {
    match <[u8; 16]>::try_from(raw) {
        Ok(bytes) => {
            let v6 = std::net::Ipv6Addr::from(bytes);
            match v6.to_ipv4_mapped() {
                Some(v4) => format!("{v6} ({v4})"),
                None => v6.to_string(),
            }
        }
        Err(_) => raw.iter().map(|b| format!("{b:02x}")).collect(),
    }
}

fn labels_text(labels: &std::collections::BTreeMap<String, String>) -> String {
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// Text for a terminal: every control character but the newline (C0, DEL, C1 such as CSI) and
/// every bidirectional override written as `\uXXXX`, so a region name, label, path or error
/// that came from the agent (or, through it, from another tenant) can never move the cursor,
/// retitle the window or reorder what is shown. JSON stays valid: serde_json has escaped C0
/// already, and a C1 or bidi character inside a string becomes the JSON escape `\uXXXX`.
pub fn terminal_safe(s: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char =
        |c: char| (c.is_control() && c != '\n') || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !s.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if unsafe_char(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

// ------------------------------------------------------------------------------------ JSON

/// A 64-bit integer as protobuf's JSON mapping writes it: a string.
pub fn u64s(v: u64) -> Value {
    Value::String(v.to_string())
}

pub fn region_json(r: &Region) -> Value {
    json!({
        "id": r.id,
        "name": r.name,
        "length": u64s(r.length),
        "kind": r.kind.as_str(),
        "path": r.path,
        "access": r.access.as_str(),
        "labels": r.labels,
        "created_at": rfc3339(&r.created_at),
        "expires_at": rfc3339(&r.expires_at),
        // 0 unless the agent runs verbs grant mode `region` (kept for a stable schema).
        "lkey": r.lkey,
        "rkey": r.rkey,
        "unavailable_reason": r.unavailable.as_deref().unwrap_or_default(),
        // 64-bit values as strings, as protobuf's JSON mapping writes uint64: a JSON number
        // above 2^53 is rounded by jq and JavaScript.
        "addr": u64s(r.addr),
    })
}

pub fn transfer_json(t: &Transfer) -> Value {
    json!({
        "id": t.id,
        "op": t.op.as_str(),
        "state": t.state.as_str(),
        "local": json!({"region": t.local_region, "offset": u64s(t.local_offset)}),
        "remote": json!({"agent": t.remote_agent, "region": t.remote_region, "offset": u64s(t.remote_offset)}),
        "length": u64s(t.length),
        "bytes_done": u64s(t.bytes_done),
        "error": t.error,
        "error_code": t.error_code,
        "created_at": rfc3339(&t.created_at),
        "started_at": rfc3339(&t.started_at),
        "finished_at": rfc3339(&t.finished_at),
        "elapsed_seconds": t.elapsed_seconds,
        "gib_per_s": crate::units::gib_per_s(t.bytes_done, t.elapsed_seconds),
        "verified": t.verified,
        "checksum": (t.checksum != 0).then(|| u64s(t.checksum)),
        "peer": t.peer,
        "inbound": t.inbound,
        "segments": u64s(t.segments),
        "notify": t.notify.as_deref().map(tag_json),
        "paths": t.paths,
        "failovers": t.failovers,
        "fallback": t.fallback,
    })
}

/// A tag as JSON: its text when it is UTF-8, and always its hex.
fn tag_json(tag: &[u8]) -> Value {
    json!({"text": std::str::from_utf8(tag).ok(), "hex": hex(tag)})
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A tag for a terminal: its text when it is printable UTF-8, else `0x` and its hex.
pub fn tag_text(tag: &[u8]) -> String {
    match std::str::from_utf8(tag) {
        Ok(s) if s.chars().all(|c| !c.is_control()) => format!("{s:?}"),
        _ => format!("0x{}", hex(tag)),
    }
}

pub fn notification_json(n: &Notification) -> Value {
    json!({
        "region": n.region,
        "peer": n.peer,
        "tag": tag_json(&n.tag),
        "op": n.op.as_str(),
        "offset": u64s(n.offset),
        "length": u64s(n.length),
        "at": rfc3339(&n.at),
        "via": n.via,
    })
}

/// One line per notification: time, region, peer, op, tag, the granted range and how it was known.
pub fn notification_line(n: &Notification) -> String {
    format!(
        "{} {} from {} {} tag {} range {}+{} via {}\n",
        rfc3339(&n.at).unwrap_or_else(|| "-".into()),
        n.region,
        if n.peer.is_empty() { "?" } else { &n.peer },
        n.op,
        tag_text(&n.tag),
        n.offset,
        n.length,
        n.via
    )
}

fn gid_json(g: &Gid) -> Value {
    json!({"index": g.index, "gid": gid_text(&g.raw), "type": g.kind, "netdev": g.netdev})
}

fn device_json(d: &Device) -> Value {
    json!({
        "name": d.name,
        "port": d.port,
        "state": d.state,
        "link_layer": d.link_layer,
        "active_mtu": d.active_mtu,
        "lid": d.lid,
        "gids": d.gids.iter().map(gid_json).collect::<Vec<_>>(),
        // -1 when none (the schema's value before it was an Option).
        "selected_gid_index": d.selected_gid_index.map_or(-1, i64::from),
        // null when unknown: software devices have no NUMA node or PCI address.
        "numa_node": d.numa_node,
        "pci_address": d.pci_address,
        "speed_mbps": d.speed_mbps.map(u64s),
        "netdev": d.netdev,
        "ipv4_prefix": d.ipv4_prefix,
    })
}

pub fn info_json(i: &AgentInfo) -> Value {
    json!({
        "node_name": i.node_name,
        "version": i.version,
        "fabric": i.fabric.as_str(),
        "fabric_reason": i.fabric_reason,
        "devices": i.devices.iter().map(device_json).collect::<Vec<_>>(),
        "limits": i.limits.as_ref().map(|l| json!({
            "memlock_soft": u64s(l.memlock_soft),
            "memlock_hard": u64s(l.memlock_hard),
            "cap_ipc_lock": l.cap_ipc_lock,
            "max_regions": l.max_regions,
            "max_registered_bytes": u64s(l.max_registered_bytes),
            "max_transfers": l.max_transfers,
        })),
        "uptime_seconds": i.uptime.map(|d| d.as_secs_f64()),
        "data_address": i.data_address,
        "regions": i.regions,
        "registered_bytes": u64s(i.registered_bytes),
        "fallback": i.fallback,
    })
}

pub fn peer_json(p: &Peer) -> Value {
    json!({
        "address": p.address,
        "node_name": p.node_name,
        "fabric": p.fabric.as_str(),
        "qps": p.qps,
        "state": p.state,
        "error": (!p.error.is_empty()).then_some(&p.error),
        "connect_seconds": p.connect_duration.map(|d| d.as_secs_f64()),
    })
}

/// Pretty-printed JSON plus a newline.
pub fn json_text(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    s.push('\n');
    s
}

// ------------------------------------------------------------------------------------ text

/// A minimal left-aligned text table.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Table { header: header.iter().map(|h| h.to_string()).collect(), rows: Vec::new() }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let cols = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(cols) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for line in std::iter::once(&self.header).chain(&self.rows) {
            let mut text = String::new();
            for (i, cell) in line.iter().enumerate().take(cols) {
                if i + 1 == cols {
                    text.push_str(cell);
                } else {
                    text.push_str(&format!("{cell:<w$}  ", w = widths[i]));
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `200 Gb/s`, `2.5 Gb/s`, `100 Mb/s`; `-` when unknown.
pub fn speed_text(mbps: Option<u64>) -> String {
    match mbps {
        None => "-".into(),
        Some(m) if m < 1000 => format!("{m} Mb/s"),
        Some(m) if m % 1000 == 0 => format!("{} Gb/s", m / 1000),
        Some(m) => format!("{} Gb/s", (format!("{}.{:03}", m / 1000, m % 1000)).trim_end_matches('0')),
    }
}

/// The selected GID's IPv4 address with its prefix (`10.0.0.1/24`, or without `/N` when the
/// prefix is unknown); `None` when the selected GID is not IPv4.
pub fn selected_ipv4_text(d: &Device) -> Option<String> {
    let gid = d.gids.iter().find(|g| Some(g.index) == d.selected_gid_index)?;
    let v4 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(gid.raw.as_slice()).ok()?).to_ipv4_mapped()?;
    Some(match d.ipv4_prefix {
        Some(p) => format!("{v4}/{p}"),
        None => v4.to_string(),
    })
}

/// Where a device port sits, on one line: speed, NUMA node, PCI address, netdev and subnet.
pub fn device_placement(d: &Device) -> String {
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let mut netdev = opt(d.netdev.clone());
    if let Some(ip) = selected_ipv4_text(d) {
        netdev.push_str(&format!(" ({ip})"));
    }
    format!(
        "speed {}, NUMA node {}, PCI {}, netdev {netdev}",
        speed_text(d.speed_mbps),
        opt(d.numa_node.map(|n| n.to_string())),
        opt(d.pci_address.clone())
    )
}

/// One row per device port: what `info` and `doctor` show when the agent has several.
pub fn device_table(devices: &[Device]) -> String {
    let mut t = Table::new(&["DEVICE", "PORT", "STATE", "LINK", "MTU", "SPEED", "NUMA", "PCI", "NETDEV", "GID"]);
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for d in devices {
        let gid = match (d.selected_gid_index, selected_ipv4_text(d)) {
            (None, _) => "none".to_string(),
            (Some(i), None) => i.to_string(),
            (Some(i), Some(ip)) => format!("{i} {ip}"),
        };
        t.row(vec![
            d.name.clone(),
            d.port.to_string(),
            d.state.clone(),
            d.link_layer.clone(),
            d.active_mtu.to_string(),
            speed_text(d.speed_mbps),
            opt(d.numa_node.map(|n| n.to_string())),
            opt(d.pci_address.clone()),
            opt(d.netdev.clone()),
            gid,
        ]);
    }
    t.render()
}

pub fn region_table(regions: &[Region]) -> String {
    let mut t = Table::new(&["NAME", "KIND", "SIZE", "ACCESS", "EXPIRES", "LABELS", "PATH", "STATUS"]);
    for r in regions {
        t.row(vec![
            r.name.clone(),
            r.kind.to_string(),
            crate::units::format_bytes(r.length),
            r.access.to_string(),
            rfc3339(&r.expires_at).unwrap_or_else(|| "-".into()),
            labels_text(&r.labels),
            r.path.clone(),
            region_status_text(r),
        ]);
    }
    t.render()
}

/// `available`, or `unavailable: REASON` for a catalog region the agent could not restore.
pub fn region_status_text(r: &Region) -> String {
    match &r.unavailable {
        None => "available".into(),
        Some(reason) => format!("unavailable: {reason}"),
    }
}

pub fn region_detail(r: &Region) -> String {
    let mut out = String::new();
    let mut kv = |k: &str, v: String| out.push_str(&format!("{k:<11} {v}\n"));
    kv("name:", r.name.clone());
    kv("id:", r.id.clone());
    kv("length:", format!("{} ({})", r.length, crate::units::format_bytes(r.length)));
    kv("kind:", r.kind.to_string());
    if !r.path.is_empty() {
        kv("path:", r.path.clone());
    }
    kv("access:", r.access.to_string());
    kv("status:", region_status_text(r));
    kv("labels:", labels_text(&r.labels));
    kv("created:", rfc3339(&r.created_at).unwrap_or_else(|| "-".into()));
    kv("expires:", rfc3339(&r.expires_at).unwrap_or_else(|| "never".into()));
    // The agent sends keys and the registered address only in verbs grant mode `region`
    // (elsewhere they are 0: remote access only through grants).
    if r.addr != 0 || r.lkey != 0 || r.rkey != 0 {
        kv("addr:", format!("{:#x}", r.addr));
        kv("lkey/rkey:", format!("{:#x} / {:#x}", r.lkey, r.rkey));
    }
    out
}

fn range_text(region: &str, offset: u64) -> String {
    if offset == 0 {
        region.to_string()
    } else {
        format!("{region}@{offset}")
    }
}

pub fn transfer_local(t: &Transfer) -> String {
    if t.local_region.is_empty() {
        "-".into()
    } else {
        range_text(&t.local_region, t.local_offset)
    }
}

pub fn transfer_remote(t: &Transfer) -> String {
    if t.remote_region.is_empty() {
        "-".into()
    } else {
        format!("{}:{}", t.remote_agent, range_text(&t.remote_region, t.remote_offset))
    }
}

pub fn transfer_table(transfers: &[Transfer]) -> String {
    let mut t = Table::new(&["ID", "OP", "STATE", "DONE", "LENGTH", "LOCAL", "REMOTE", "SECONDS", "ERROR"]);
    for x in transfers {
        let error = match (x.error.is_empty(), x.error_code.is_empty()) {
            (true, true) => String::new(),
            (false, true) => x.error.clone(),
            (true, false) => x.error_code.clone(),
            (false, false) => format!("{} ({})", x.error, x.error_code),
        };
        t.row(vec![
            x.id.clone(),
            x.op.to_string() + if x.inbound { " (in)" } else { "" },
            x.state.to_string(),
            crate::units::format_bytes(x.bytes_done),
            crate::units::format_bytes(x.length),
            transfer_local(x),
            transfer_remote(x),
            format!("{:.3}", x.elapsed_seconds),
            error,
        ]);
    }
    t.render()
}

pub fn transfer_detail(t: &Transfer) -> String {
    let mut out = String::new();
    let mut kv = |k: &str, v: String| out.push_str(&format!("{k:<10} {v}\n"));
    kv("id:", t.id.clone());
    kv("op:", t.op.to_string() + if t.inbound { " (inbound)" } else { "" });
    kv("state:", t.state.to_string());
    kv("local:", transfer_local(t));
    kv("remote:", transfer_remote(t));
    if !t.peer.is_empty() {
        kv("peer:", t.peer.clone());
    }
    kv("progress:", format!("{} / {} bytes", t.bytes_done, t.length));
    kv("elapsed:", format!("{:.3} s ({:.3} GiB/s)", t.elapsed_seconds, crate::units::gib_per_s(t.bytes_done, t.elapsed_seconds)));
    kv("created:", rfc3339(&t.created_at).unwrap_or_else(|| "-".into()));
    kv("started:", rfc3339(&t.started_at).unwrap_or_else(|| "-".into()));
    kv("finished:", rfc3339(&t.finished_at).unwrap_or_else(|| "-".into()));
    if t.paths > 1 || t.failovers > 0 {
        let lost = match t.failovers {
            0 => String::new(),
            n => format!(" ({n} lost mid-transfer: it ran degraded, every byte landed on the others)"),
        };
        kv("paths:", format!("{}{lost}", t.paths));
    }
    if t.fallback {
        kv("fallback:", "fell back to tcp (every RDMA path was lost)".into());
    }
    if t.verified {
        kv("verified:", format!("yes (checksum {:#018x})", t.checksum));
    }
    if !t.error.is_empty() || !t.error_code.is_empty() {
        kv("error:", format!("{} ({})", t.error, t.error_code));
    }
    out
}

pub fn peer_table(peers: &[Peer]) -> String {
    let mut t = Table::new(&["ADDRESS", "NODE", "FABRIC", "QPS", "STATE", "CONNECT"]);
    for p in peers {
        t.row(vec![
            p.address.clone(),
            p.node_name.clone(),
            p.fabric.to_string(),
            p.qps.to_string(),
            if p.error.is_empty() { p.state.clone() } else { format!("{} ({})", p.state, p.error) },
            p.connect_duration.map(|d| format!("{:.3} ms", d.as_secs_f64() * 1e3)).unwrap_or_else(|| "-".into()),
        ]);
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_output_escapes_control_and_bidi_characters() {
        assert_eq!(terminal_safe("plain\nline"), "plain\nline");
        let hostile = "a\u{1b}]0;pwned\u{7}b\u{9b}2Jc\rd\u{202e}e\u{7f}";
        let safe = terminal_safe(hostile);
        assert!(!safe.chars().any(|c| c.is_control() || c == '\u{202e}'), "{safe:?}");
        assert_eq!(safe, "a\\u001b]0;pwned\\u0007b\\u009b2Jc\\u000dd\\u202ee\\u007f");
        // JSON with a C1 character inside a string is still JSON, with the same value.
        let doc = json_text(&json!({"name": "x\u{9b}y"}));
        let back: Value = serde_json::from_str(&terminal_safe(&doc)).unwrap();
        assert_eq!(back["name"], "x\u{9b}y");
    }

    #[test]
    fn gids() {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[10, 0, 0, 2]);
        assert_eq!(gid_text(&raw), "::ffff:10.0.0.2 (10.0.0.2)");
        assert_eq!(gid_text(&[1, 2]), "0102");
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(&["A", "LONGER"]);
        t.row(vec!["xxxx".into(), "y".into()]);
        assert_eq!(t.render(), "A     LONGER\nxxxx  y\n");
    }

    #[test]
    fn region_keys_only_when_the_agent_sends_them() {
        // mr / mw / tcp: the agent sends 0 (remote access only through grants).
        let r = Region { name: "dst".into(), ..Default::default() };
        let text = region_detail(&r);
        assert!(!text.contains("lkey") && !text.contains("addr:"), "{text}");
        let v = region_json(&r);
        assert_eq!((v["lkey"].clone(), v["rkey"].clone(), v["addr"].clone()), (0.into(), 0.into(), "0".into()));
        assert_eq!(v["length"], "0", "64-bit integers are strings");
        // Grant mode region: the region MR's keys are its remote access, and are shown.
        let r = Region { name: "dst".into(), lkey: 0x1234, rkey: 0x1234, addr: 0x7f00_0000_1000, ..Default::default() };
        let text = region_detail(&r);
        assert!(text.contains("lkey/rkey:  0x1234 / 0x1234"), "{text}");
        assert!(text.contains("addr:       0x7f0000001000"), "{text}");
    }

    #[test]
    fn transfer_json_fields() {
        let t = Transfer {
            id: "t1".into(),
            op: xfer_client::Op::Write,
            state: xfer_client::State::Failed,
            error_code: "REM_ACCESS_ERR".into(),
            ..Default::default()
        };
        let v = transfer_json(&t);
        assert_eq!(v["op"], "write");
        assert_eq!(v["state"], "failed");
        assert_eq!(v["error_code"], "REM_ACCESS_ERR");
        assert_eq!(v["started_at"], Value::Null);
        // Protobuf's JSON mapping: every 64-bit integer a string, an absent checksum null.
        for (k, want) in [("length", "0"), ("bytes_done", "0"), ("segments", "0")] {
            assert_eq!(v[k], want, "{k}");
        }
        assert_eq!((v["local"]["offset"].clone(), v["remote"]["offset"].clone()), ("0".into(), "0".into()));
        assert_eq!(v["checksum"], Value::Null, "no checksum was computed");
    }

    /// 64-bit checksums and addresses are strings in JSON: as numbers, anything above 2^53 would
    /// be rounded by jq and JavaScript (protobuf's JSON mapping writes uint64 as strings too).
    #[test]
    fn u64_values_are_json_strings_and_survive_a_round_trip() {
        let big = u64::MAX - 2; // not representable as an f64
        let t = Transfer { id: "t1".into(), verified: true, checksum: big, ..Default::default() };
        let text = json_text(&transfer_json(&t));
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back["checksum"], big.to_string());
        assert_eq!(back["checksum"].as_str().and_then(|s| s.parse::<u64>().ok()), Some(big));
        let r = Region { name: "r".into(), addr: big, ..Default::default() };
        assert_eq!(region_json(&r)["addr"], big.to_string());
    }
}
