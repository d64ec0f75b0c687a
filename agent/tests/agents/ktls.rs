//! `tls.kernel` (kernel TLS on the tcp data streams) on a host whose kernel cannot take them
//! (no `tls` module): with `auto` every stream falls back to rustls and carries its bytes, the
//! counter says so and the agent says why once; an agent with `off` never tries. The runs where
//! the kernel does take them are in the device binary (`device::ktls`, in the Soft-RoCE VM).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::pki::Pki;
use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_falls_back_to_rustls_stream_by_stream_and_off_never_tries() {
    let pki = Pki::new();
    let (a, _ta) = ktls_agent(&pki, "node-a", "auto");
    let (b, _tb) = ktls_agent(&pki, "node-b", "auto");
    let (c, _tc) = ktls_agent(&pki, "node-c", "off");
    write_and_read(&pki, &a, &b, 1 << 20, 1).await;
    // Mixed pairs: `auto` initiator and `off` target, then the other way round.
    write_and_read(&pki, &a, &c, 64 << 10, 2).await;
    write_and_read(&pki, &c, &b, 64 << 10, 3).await;

    let has_tls = kernel_has_tls();
    let (went, stayed) = if has_tls { ("kernel", "fallback") } else { ("fallback", "kernel") };
    for (agent, role) in [(&a, "initiator"), (&b, "target")] {
        assert!(ktls_streams(agent, role, went) >= 2.0, "{role} streams not counted {went}: {}", scrape(agent));
        assert_eq!(ktls_streams(agent, role, stayed), 0.0, "{role}: {}", scrape(agent));
        assert_eq!(ktls_streams(agent, role, "failed"), 0.0, "{role}: {}", scrape(agent));
    }
    // Both of b's peers' streams (a's `auto`, c's `off`) were b's to decide: at least four.
    assert!(ktls_streams(&b, "target", went) >= 4.0, "{}", scrape(&b));
    assert_eq!(ktls_streams_any(&c), 0.0, "an `off` agent counted kTLS streams: {}", scrape(&c));
    if !has_tls {
        for agent in [&a, &b] {
            let logs = agent.logs();
            let said = logs.matches("tls.kernel = auto, but data streams stay with rustls").count();
            assert_eq!(said, 1, "the fallback is said once per agent:\n{logs}");
            assert!(logs.contains("tls module"), "the reason names the missing module:\n{logs}");
        }
    }
    assert!(!c.logs().contains("tls.kernel"), "{}", c.logs());
}
