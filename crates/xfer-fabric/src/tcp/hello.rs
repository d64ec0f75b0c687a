//! The hello a data stream starts with: the connection it belongs to and the secret that
//! binds it to that connection (handed out by an authenticated `Peer.Connect`).
use tokio::io::{AsyncRead, AsyncReadExt};

use super::serve::ServeError;
use crate::DataSecret;
use xfer_engine::ids::ConnectionId;

/// First bytes of a data stream's hello (protocol version 1).
pub(super) const HELLO_MAGIC: &[u8; 4] = b"XFR1";
/// The hello the initiator sends on a new data stream of `connection`.
pub(super) fn encode_hello(connection: &ConnectionId, secret: &DataSecret) -> Vec<u8> {
    let id = connection.as_str();
    let mut hello = Vec::with_capacity(4 + 1 + id.len() + 32);
    hello.extend_from_slice(HELLO_MAGIC);
    hello.push(id.len() as u8);
    hello.extend_from_slice(id.as_bytes());
    hello.extend_from_slice(&secret.0);
    hello
}

/// Reads a stream's hello: the connection id and its secret. Public (but not API) for the fuzz
/// target.
#[doc(hidden)]
pub async fn read_hello<R: AsyncRead + Unpin>(rd: &mut R) -> Result<(ConnectionId, [u8; 32]), ServeError> {
    let mut head = [0u8; 5];
    rd.read_exact(&mut head).await?;
    if &head[..4] != HELLO_MAGIC {
        return Err(ServeError::Hello("not an xfer data stream (bad magic)"));
    }
    let n = head[4] as usize;
    if n == 0 || n > 64 {
        return Err(ServeError::Hello("connection id must be 1-64 bytes"));
    }
    let mut id = vec![0u8; n];
    rd.read_exact(&mut id).await?;
    let id = std::str::from_utf8(&id).map_err(|_| ServeError::Hello("connection id is not UTF-8"))?;
    let id = ConnectionId::parse(id).map_err(|_| ServeError::Hello("connection id must be 1-64 characters from [A-Za-z0-9_.-]"))?;
    let mut secret = [0u8; 32];
    rd.read_exact(&mut secret).await?;
    Ok((id, secret))
}
