//! Kernel TLS on the tcp data streams (`tls.kernel`): mTLS agents with the option, a WRITE and
//! a READ between two of them with their bytes checked, and the agents' per-stream counter
//! (`xfer_data_ktls_streams_total`).
use xfer_proto::v1 as pb;

use super::pki::Pki;
use super::{anon, labelled, random_bytes, read_via, run_via, scrape, write_req, Agent};

/// An mTLS agent under certificate `name` with `tls.kernel = kernel` (`off` or `auto`).
pub fn ktls_agent(pki: &Pki, name: &str, kernel: &str) -> (Agent, tempfile::TempDir) {
    pki.agent_with(name, "", &format!("kernel = {kernel:?}"), &[])
}

/// `xfer_data_ktls_streams_total{role, result}` of `a` (0 when absent).
pub fn ktls_streams(a: &Agent, role: &str, result: &str) -> f64 {
    labelled(&scrape(a), "xfer_data_ktls_streams_total", &[("role", role), ("result", result)])
}

/// Every sample of `xfer_data_ktls_streams_total` of `a`, summed.
pub fn ktls_streams_any(a: &Agent) -> f64 {
    labelled(&scrape(a), "xfer_data_ktls_streams_total", &[])
}

/// `len` bytes WRITTEN from `a` to `b`, then READ back from `b` into another region of `a`,
/// both on `a`'s data streams to `b`; the bytes arrive intact both ways.
pub async fn write_and_read(pki: &Pki, a: &Agent, b: &Agent, len: usize, seed: u64) {
    let mut ca = pki.agent_client(a, "xferctl").await;
    let mut cb = pki.agent_client(b, "xferctl").await;
    let (src, dst, back) = (format!("src-{seed}"), format!("dst-{seed}"), format!("back-{seed}"));
    for (c, name) in [(&ca, &src), (&cb, &dst), (&ca, &back)] {
        c.clone().create_region(anon(name, len as u64)).await.unwrap();
    }
    let data = random_bytes(len, seed);
    let msgs: Vec<pb::WriteRegionRequest> = data
        .chunks(1 << 20)
        .enumerate()
        .map(|(i, c)| pb::WriteRegionRequest { region: if i == 0 { src.clone() } else { String::new() }, offset: 0, data: c.to_vec() })
        .collect();
    ca.write_region(futures::stream::iter(msgs)).await.unwrap();

    let t = run_via(&mut ca, write_req(&src, b, &dst, len as u64)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "WRITE {len}: {t:?}\nA: {}\nB: {}", a.logs(), b.logs());
    assert!(read_via(&mut cb, &dst, 0, 0).await == data, "WRITE {len}: the bytes differ at the target");

    let mut read = write_req(&back, b, &dst, len as u64);
    read.op = pb::Op::Read as i32;
    let t = run_via(&mut ca, read).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "READ {len}: {t:?}\nA: {}\nB: {}", a.logs(), b.logs());
    assert!(read_via(&mut ca, &back, 0, 0).await == data, "READ {len}: the bytes differ at the initiator");
}

/// Whether this machine's kernel has the `tls` upper-layer protocol registered now.
pub fn kernel_has_tls() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp").is_ok_and(|u| u.split_whitespace().any(|u| u == "tls"))
}
