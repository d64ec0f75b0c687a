//! The tcp fabric's data streams spoken by hand, for attacks the product's own initiator would
//! never make: a hello, frame headers encoded and answers decoded with the product's codec
//! (`fabric::frame`), raw WRITE and READ requests.
use xfer_proto::v1 as pb;

use super::{Agent, READ_GUARD};

pub use xfer_fabric::frame::{self, Header, Kind};

/// A data stream to `address` whose hello names `connection_id` and presents `secret`.
pub fn open_data_stream(address: &str, connection_id: &str, secret: &[u8]) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(address).unwrap();
    s.set_read_timeout(Some(READ_GUARD)).unwrap();
    let mut hello = b"XFR1".to_vec();
    hello.push(connection_id.len() as u8);
    hello.extend_from_slice(connection_id.as_bytes());
    hello.extend_from_slice(secret);
    s.write_all(&hello).unwrap();
    s
}

/// A tcp-fabric frame header as an initiator sends it, encoded by the product's codec
/// (`fabric::frame`): `flags` 1 = ACK requested.
pub fn frame_header(kind: Kind, flags: u8, id: u64, token: [u8; 16], addr: u64, len: u32) -> [u8; frame::HEADER_LEN] {
    Header { kind, flags, status: 0, id, addr, len, token }.encode()
}

/// Reads one answer frame (ACK, NAK or READ_RESP) and decodes it with the product's codec:
/// (status, kind, id).
pub fn read_frame_answer<S: std::io::Read>(s: &mut S) -> (u16, Kind, u64) {
    let h = read_header(s);
    (h.status, h.kind, h.id)
}

/// Reads and decodes one frame header; a header the codec refuses fails the test.
pub fn read_header<S: std::io::Read>(s: &mut S) -> Header {
    let mut r = [0u8; frame::HEADER_LEN];
    s.read_exact(&mut r).unwrap();
    Header::decode(&r).unwrap_or_else(|e| panic!("the agent sent a frame its own codec refuses: {e}"))
}

/// The agent has closed `s` (after whatever it sent, which must be nothing more): the read ends
/// at EOF, or in a reset, or (TLS) without a close_notify. A read that runs into [`READ_GUARD`]
/// means the stream is still open and silent: that fails, it never passes for a close.
pub fn assert_closed<S: std::io::Read>(s: &mut S, what: &str) {
    use std::io::ErrorKind::*;
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => {}
        Err(e) if matches!(e.kind(), ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof) => {}
        Err(e) => panic!("{what}: the stream is still open (read: {e}) after {} bytes: {rest:?}", rest.len()),
    }
    assert!(rest.is_empty(), "{what}: the stream sent {} more bytes before it closed: {rest:?}", rest.len());
}

/// A tcp grant's 16-byte token.
pub fn token_of(g: &pb::GrantResponse) -> [u8; 16] {
    g.token.as_slice().try_into().unwrap()
}

/// One `Peer.Connect` session (plaintext) of connection `id`; `open` opens another data stream
/// of it.
pub struct DataSession(String, Vec<u8>, &'static str);

impl DataSession {
    pub async fn of(a: &Agent, id: &'static str) -> DataSession {
        let (addr, secret) = a.data_session(id).await;
        DataSession(addr, secret, id)
    }

    pub fn open(&self) -> std::net::TcpStream {
        open_data_stream(&self.0, self.2, &self.1)
    }
}

/// Sends one WRITE frame (ACK requested) on `s`; returns (NAK/ACK status, frame kind).
pub fn raw_write(s: &mut std::net::TcpStream, token: [u8; 16], addr: u64, payload: &[u8]) -> (u16, Kind) {
    use std::io::Write;
    s.write_all(&frame_header(Kind::Write, frame::ACK_REQUESTED, 7, token, addr, payload.len() as u32)).unwrap();
    s.write_all(payload).unwrap();
    let h = read_header(s);
    (h.status, h.kind)
}

/// Sends one READ request frame on `s`; returns (status, kind, payload).
pub fn raw_read(s: &mut std::net::TcpStream, token: [u8; 16], addr: u64, len: u32) -> (u16, Kind, Vec<u8>) {
    use std::io::{Read, Write};
    s.write_all(&frame_header(Kind::ReadReq, 0, 9, token, addr, len)).unwrap();
    let h = read_header(s);
    let mut data = vec![0u8; h.payload_len() as usize];
    s.read_exact(&mut data).unwrap();
    (h.status, h.kind, data)
}
