//! Wire format of the TCP fabric: fixed 44-byte little-endian headers, optionally
//! followed by a payload whose length the header gives.
//!
//! ```text
//! 0      4     5      6        8        16       24       28            44
//! | magic | kind | flags | status | id (u64) | addr (u64) | len (u32) | token [16] |
//! ```
//! * `WRITE{id, token, addr, len}` + `len` payload bytes; `flags & ACK_REQUESTED` asks for an ACK.
//! * `READ_REQ{id, token, addr, len}`; answered by `READ_RESP{id, status, len}` + payload when
//!   status is 0.
//! * `ACK{id}` / `NAK{id, status}`: status values are `ibv_wc_status` codes (see `WcStatus`).
//! * `NOTIFY{id, token}`: a notification marker for the grant `token` names; no payload.
//!   `flags & ACK_REQUESTED` asks for an ACK; a refused marker is NAKed.
//!
//! Decoding is pure and total: any 44 bytes decode to a header or a [`FrameError`]; it is fuzzed.

/// "XFR1"
pub const MAGIC: u32 = 0x3152_4658;
pub const HEADER_LEN: usize = 44;
/// Largest payload a single frame may carry (bounds the chunk size).
pub const MAX_PAYLOAD: u32 = 256 << 20;
pub const ACK_REQUESTED: u8 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Write = 1,
    ReadReq = 2,
    ReadResp = 3,
    Ack = 4,
    Nak = 5,
    Notify = 6,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub flags: u8,
    pub status: u16,
    pub id: u64,
    pub addr: u64,
    pub len: u32,
    pub token: [u8; 16],
}

impl std::fmt::Debug for Header {
    // The token is a grant's secret and the address a remote memory address: neither is printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Header")
            .field("kind", &self.kind)
            .field("flags", &self.flags)
            .field("status", &self.status)
            .field("id", &self.id)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("payload length {0} exceeds the maximum {MAX_PAYLOAD}")]
    TooLong(u32),
    #[error("{0:?} frame must not carry a payload length")]
    UnexpectedLen(Kind),
}

impl Header {
    pub fn new(kind: Kind, id: u64) -> Self {
        Header { kind, flags: 0, status: 0, id, addr: 0, len: 0, token: [0; 16] }
    }

    /// A NAK of frame `id` with `status`.
    pub fn nak(id: u64, status: crate::status::WcStatus) -> Self {
        Header { status: status.code(), ..Header::new(Kind::Nak, id) }
    }

    /// Bytes of payload that follow this header on the wire.
    pub fn payload_len(&self) -> u32 {
        match self.kind {
            Kind::Write => self.len,
            Kind::ReadResp if self.status == 0 => self.len,
            _ => 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.flags;
        b[6..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..44].copy_from_slice(&self.token);
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let kind = match b[4] {
            1 => Kind::Write,
            2 => Kind::ReadReq,
            3 => Kind::ReadResp,
            4 => Kind::Ack,
            5 => Kind::Nak,
            6 => Kind::Notify,
            k => return Err(FrameError::BadKind(k)),
        };
        let len = u32_at(24);
        if len > MAX_PAYLOAD {
            return Err(FrameError::TooLong(len));
        }
        if matches!(kind, Kind::Ack | Kind::Nak | Kind::Notify) && len != 0 {
            return Err(FrameError::UnexpectedLen(kind));
        }
        let mut token = [0u8; 16];
        token.copy_from_slice(&b[28..44]);
        Ok(Header { kind, flags: b[5], status: u16::from_le_bytes([b[6], b[7]]), id: u64_at(8), addr: u64_at(16), len, token })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_token_and_the_address() {
        let mut h = Header::new(Kind::Write, 7);
        h.addr = 0xdead_beef_0000;
        h.token = [0xab; 16];
        let d = format!("{h:?}");
        assert!(!d.contains("171") && !d.contains("ab") && !d.contains("0xdead") && !d.contains(&0xdead_beef_0000u64.to_string()), "{d}");
        assert!(d.contains("Write") && d.contains("id: 7"), "{d}");
    }

    #[test]
    fn roundtrip() {
        let h = Header {
            kind: Kind::Write,
            flags: ACK_REQUESTED,
            status: 0,
            id: 0xdead_beef_1234,
            addr: 0x7f00_0000_1000,
            len: 4096,
            token: [7; 16],
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        assert_eq!(h.payload_len(), 4096);
    }

    #[test]
    fn rejects_garbage() {
        let mut b = Header::new(Kind::Ack, 1).encode();
        b[0] = b'G';
        assert!(matches!(Header::decode(&b), Err(FrameError::BadMagic(_))));
        let mut b = Header::new(Kind::Ack, 1).encode();
        b[4] = 99;
        assert_eq!(Header::decode(&b), Err(FrameError::BadKind(99)));
        let mut h = Header::new(Kind::Write, 1);
        h.len = MAX_PAYLOAD + 1;
        assert_eq!(Header::decode(&h.encode()), Err(FrameError::TooLong(MAX_PAYLOAD + 1)));
        let mut h = Header::new(Kind::Nak, 1);
        h.len = 5;
        assert_eq!(Header::decode(&h.encode()), Err(FrameError::UnexpectedLen(Kind::Nak)));
        // A NOTIFY carries no payload: a length would desynchronise the stream.
        let mut h = Header::new(Kind::Notify, 1);
        h.len = 5;
        assert_eq!(Header::decode(&h.encode()), Err(FrameError::UnexpectedLen(Kind::Notify)));
        h.len = 0;
        assert_eq!(Header::decode(&h.encode()).map(|h| h.payload_len()), Ok(0));
    }

    #[test]
    fn failed_read_resp_has_no_payload() {
        let mut h = Header::new(Kind::ReadResp, 3);
        h.len = 100;
        h.status = 10;
        assert_eq!(h.payload_len(), 0);
        h.status = 0;
        assert_eq!(h.payload_len(), 100);
    }
}
