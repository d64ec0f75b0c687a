//! Connecting to an agent's gRPC endpoint.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use xfer_proto::v1::agent_client::AgentClient;

use crate::error::Failure;

/// How long to wait for the TCP (and HTTP/2) connection to an agent.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The generated client for the `xfer.v1.Agent` service.
pub type Client = AgentClient<Channel>;

/// Connects to the agent at `addr` (`host:port`). Connection problems become
/// [`Failure::Connect`], which exits with the UNAVAILABLE code.
pub async fn connect(addr: &str) -> anyhow::Result<Client> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| anyhow::anyhow!("invalid agent address {addr:?}: {e}"))?;
    let channel = endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| Failure::Connect {
            addr: addr.to_string(),
            reason: root_cause(&e),
        })?;
    // Large ReadRegion/WriteRegion messages (1 MiB of data plus framing) exceed tonic's 4 MiB
    // default only if an agent chose bigger chunks; allow generous limits anyway.
    Ok(AgentClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20))
}

/// The innermost error message, e.g. "Connection refused (os error 111)" instead of tonic's
/// "transport error".
fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = err;
    while let Some(next) = cur.source() {
        cur = next;
    }
    let text = cur.to_string();
    if text.is_empty() || text == "transport error" {
        "connection failed".to_string()
    } else {
        text
    }
}
