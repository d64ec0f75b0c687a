//! Grant checking on the data plane: the fabric asks the agent's grant table whether a one-sided
//! operation that arrived from a peer may touch memory ([`AccessCheck`]), and holds the grant's
//! [`GrantGate`] while it copies the bytes in, so a revocation is immediate.
//!
//! The tcp fabric checks every frame here; on verbs the device checks keys, and the gate only
//! orders a grant's notifications against its revocation.
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use xfer_rdma::memory::RegionMemory;

use crate::{RemoteOp, WcStatus};
use xfer_engine::ids::ConnectionId;

/// The target's grant table as the data plane sees it (the tcp fabric checks every frame with it): resolves a frame's token and range to
/// region memory, or the status to NAK with.
pub trait AccessCheck: Send + Sync + 'static {
    /// Returns the memory, the offset inside it and the grant's [`GrantGate`] for `len` bytes at
    /// remote address `addr`, for a frame that arrived on a data stream of connection
    /// `connection`.
    fn check(&self, connection: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus>;
    /// A NOTIFY frame (a notification marker) under `token` with immediate `imm` arrived on a
    /// data stream of `connection`, after every earlier frame of that stream was served. `Err`
    /// NAKs it.
    fn marker(&self, connection: &ConnectionId, token: &[u8; 16], imm: u32) -> Result<(), WcStatus>;
}

/// A frame that passed [`AccessCheck::check`]: where its bytes go, and the gate of the grant
/// that allowed it.
pub struct Checked {
    pub memory: Arc<RegionMemory>,
    pub offset: u64,
    pub gate: Arc<GrantGate>,
    /// The whole grant, when a stream may check its later frames under the same token against
    /// it ([`Checked::again`]) instead of asking the table for each; `None`: it asks for each.
    pub window: Option<Window>,
}

/// What a grant allows, as the data plane checks a frame against it: one operation on the remote
/// addresses `start..start + len`, where remote address `base` is offset 0 of the grant's memory.
/// A grant never changes while it lives (revocation and expiry end its [`GrantGate`] instead), so
/// a frame inside it is allowed while the gate is live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub op: RemoteOp,
    pub start: u64,
    pub len: u64,
    pub base: u64,
}

impl Window {
    /// The memory offset of `len` bytes at remote address `addr` for `op`, if the grant covers
    /// them (every sum checked for overflow); `RemAccessErr` otherwise. The caller still checks
    /// the gate and the memory's own bounds.
    pub fn offset(&self, addr: u64, len: u64, op: RemoteOp) -> Result<u64, WcStatus> {
        let end = self.start.checked_add(self.len).ok_or(WcStatus::RemAccessErr)?;
        let req_end = addr.checked_add(len).ok_or(WcStatus::RemAccessErr)?;
        if op != self.op || addr < self.start || req_end > end || addr < self.base {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(addr - self.base)
    }
}

impl Checked {
    /// The memory offset of a later frame (`len` bytes at `addr` for `op`) under the same token,
    /// if this check may stand for it (see [`Checked::window`]) and the grant and the memory
    /// cover it. Whether the grant is still live is the gate's to tell, checked by the caller
    /// under the hold that copies the bytes.
    pub fn again(&self, addr: u64, len: u64, op: RemoteOp) -> Option<u64> {
        let offset = self.window?.offset(addr, len, op).ok()?;
        self.memory.check(offset, len).ok()?;
        Some(offset)
    }
}

/// A grant's liveness as the data plane sees it. A WRITE payload is copied into region memory in
/// chunks of at most [`PAYLOAD_CHUNK`], each under a read lock of `live` and only while the gate
/// is live and unexpired; [`GrantGate::revoke`] takes the write lock, so once it returns no byte
/// lands under this gate any more. It also cancels `revoked`, which closes a stream waiting for
/// the rest of such a payload at once.
#[derive(Debug)]
pub struct GrantGate {
    live: std::sync::RwLock<bool>,
    revoked: CancellationToken,
    expires_at: std::time::SystemTime,
}

/// Most bytes copied into region memory per check of a [`GrantGate`]: a revocation waits for at
/// most one such copy of bytes already received (tens of microseconds). 256 KiB rather than
/// 64 KiB: a large payload read straight from the socket costs a system call per chunk, and
/// quartering them cut the target's CPU per GiB by 11-15% at 1 and 16 MiB messages.
pub const PAYLOAD_CHUNK: usize = 256 << 10;

impl GrantGate {
    pub fn new(expires_at: std::time::SystemTime) -> Arc<GrantGate> {
        Arc::new(GrantGate { live: std::sync::RwLock::new(true), revoked: CancellationToken::new(), expires_at })
    }

    /// Ends the gate. Waits for a chunk being copied under it (never for the network: chunks
    /// are copied from bytes already received); after it returns, no byte is written under it.
    pub fn revoke(&self) {
        *self.live.write().unwrap_or_else(|p| p.into_inner()) = false;
        self.revoked.cancel();
    }

    /// Whether the gate is neither revoked nor expired (a snapshot).
    pub fn is_live(&self) -> bool {
        self.hold().is_some()
    }

    /// Runs `f` with the gate held live (None, without running it, once revoked or expired):
    /// a [`GrantGate::revoke`] waits for `f`, so once it returns `f` has run or never will.
    /// `f` must not block or revoke.
    pub fn while_live<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let _live = self.hold()?;
        Some(f())
    }

    /// Resolves once the gate is revoked: a stream waiting for the rest of a payload under it
    /// is closed at once instead of at its payload deadline.
    pub(crate) async fn revoked(&self) {
        self.revoked.cancelled().await
    }

    /// Holds the gate live while the guard lives (revocation waits for it); None once revoked
    /// or expired.
    pub(crate) fn hold(&self) -> Option<std::sync::RwLockReadGuard<'_, bool>> {
        let g = self.live.read().unwrap_or_else(|p| p.into_inner());
        (*g && std::time::SystemTime::now() < self.expires_at).then_some(g)
    }
}
