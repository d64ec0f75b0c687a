//! `tls.kernel = auto` where the kernel takes the streams (the Soft-RoCE VM's Debian kernel has
//! the `tls` module): two mTLS agents on the tcp fabric hand every data stream's record layer
//! to the kernel after the handshake (the counter says `kernel`, never `fallback`), and WRITE
//! and READ bytes arrive intact at 4 KiB and 16 MiB; a mixed pair (one `auto`, one `off`: the
//! kernel on one end, rustls on the other) works both ways. Needs no RDMA device, only the
//! module: `modprobe tls` first, and a kernel where it cannot be loaded FAILS these tests
//! (`scripts/rxe-guest-test` runs them with `--include-ignored`). On a host without the module
//! they report as ignored; the host's fallback is `agents::ktls`.
use crate::common::pki::Pki;
use crate::common::{kernel_has_tls, ktls_agent, ktls_streams, scrape, write_and_read};

/// Loads the kernel's `tls` module; a kernel without it fails the test.
fn load_tls_module() {
    let st = std::process::Command::new("modprobe").arg("tls").status();
    assert!(st.as_ref().is_ok_and(|s| s.success()), "modprobe tls: {st:?}");
    assert!(kernel_has_tls(), "tls is not in /proc/sys/net/ipv4/tcp_available_ulp after modprobe tls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the kernel tls module"]
async fn auto_on_both_agents_hands_every_stream_to_the_kernel() {
    load_tls_module();
    let pki = Pki::new();
    let (a, _ta) = ktls_agent(&pki, "node-a", "auto");
    let (b, _tb) = ktls_agent(&pki, "node-b", "auto");
    write_and_read(&pki, &a, &b, 4 << 10, 1).await;
    write_and_read(&pki, &a, &b, 16 << 20, 2).await;
    for (agent, role) in [(&a, "initiator"), (&b, "target")] {
        assert!(ktls_streams(agent, role, "kernel") >= 2.0, "{role}: {}", scrape(agent));
        assert_eq!(ktls_streams(agent, role, "fallback"), 0.0, "{role}: {}\n{}", scrape(agent), agent.logs());
        assert_eq!(ktls_streams(agent, role, "failed"), 0.0, "{role}: {}\n{}", scrape(agent), agent.logs());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the kernel tls module"]
async fn a_kernel_end_and_a_rustls_end_work_together_both_ways() {
    load_tls_module();
    let pki = Pki::new();
    let (a, _ta) = ktls_agent(&pki, "node-a", "auto");
    let (c, _tc) = ktls_agent(&pki, "node-c", "off");
    // `auto` initiator, `off` target; then `off` initiator, `auto` target.
    write_and_read(&pki, &a, &c, 4 << 10, 3).await;
    write_and_read(&pki, &a, &c, 16 << 20, 4).await;
    write_and_read(&pki, &c, &a, 4 << 10, 5).await;
    write_and_read(&pki, &c, &a, 16 << 20, 6).await;
    for role in ["initiator", "target"] {
        assert!(ktls_streams(&a, role, "kernel") >= 2.0, "{role}: {}", scrape(&a));
        assert_eq!(ktls_streams(&a, role, "fallback") + ktls_streams(&a, role, "failed"), 0.0, "{role}: {}", scrape(&a));
    }
}
