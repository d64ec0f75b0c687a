//! Completion queue (extended CQ) with an optional completion channel, and [`watch_channel`],
//! which registers a completion channel's fd with tokio.
//!
//! Unsafe lives here because the CQ is a raw libibverbs object (created, polled, armed and
//! destroyed through its pointer) and tokio's `AsyncFd::register_with_interest` is `unsafe` (the
//! fd must stay open while registered).
//!
//! Wrapped here over rdma-mummy-sys rather than sideway because sideway 0.4 has no
//! `ibv_req_notify_cq` / `ibv_get_cq_event` / `ibv_ack_cq_events`, and its CQ `Drop` does
//! `assert_eq!(ibv_destroy_cq(..), 0)`. This wrapper logs a failed destroy instead of panicking.
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::CompletionChannel;
use sideway::ibverbs::device_context::DeviceContext;

use tokio::io::unix::AsyncFd;

use crate::error::VerbsError;

/// One work completion as read from a [`Cq`] (status kept raw: unknown values never panic). Made
/// only by [`Cq::poll`] and neither `Clone` nor `Copy`, so it can retire in-flight WRs
/// ([`crate::qp::RcQp::retire`]) once.
#[derive(Debug, PartialEq, Eq)]
pub struct RawWc {
    wr_id: u64,
    status: u32,
    byte_len: u32,
    qp_num: u32,
    /// The immediate of a received RDMA WRITE WITH IMMEDIATE (host order), if it carried one.
    imm: Option<u32>,
    /// Id of the `Cq` it was read from.
    cq: u64,
}

impl RawWc {
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }
    /// `ibv_wc_status` code (0 = success).
    pub fn status(&self) -> u32 {
        self.status
    }
    pub fn is_success(&self) -> bool {
        self.status == 0 // IBV_WC_SUCCESS
    }
    pub fn byte_len(&self) -> u32 {
        self.byte_len
    }
    /// The QP the completion belongs to (reliable even where a flush's `wr_id` is not).
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }
    /// The immediate data of a receive completion that carried one (`IBV_WC_WITH_IMM`), in host
    /// byte order.
    pub fn imm(&self) -> Option<u32> {
        self.imm
    }
    /// True if the completion was read from `cq`.
    pub(crate) fn from(&self, cq: &Arc<Cq>) -> bool {
        self.cq == cq.id
    }
}

pub struct Cq {
    cq: NonNull<sys::ibv_cq_ex>,
    /// Unique for the life of the process: tells completions of different CQs apart.
    id: u64,
    /// The next QP index handed out on this CQ (`RcQp::create`); indices are never reused.
    next_index: AtomicUsize,
    /// Serializes polling (one reader per CQ keeps the in-flight bookkeeping in order).
    poll_lock: Mutex<()>,
    // Drop order: the CQ is destroyed in `Drop::drop` before these fields are released, so the
    // channel and the context outlive it.
    channel: Option<Arc<CompletionChannel>>,
    _ctx: Arc<DeviceContext>,
}

// SAFETY: libibverbs CQ objects may be used from any thread; polling is serialized by
// `poll_lock`, and `ibv_req_notify_cq` is thread-safe.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub fn new(ctx: &Arc<DeviceContext>, cqe: u32, channel: Option<&Arc<CompletionChannel>>) -> Result<Arc<Cq>, VerbsError> {
        let mut attr = sys::ibv_cq_init_attr_ex {
            cqe,
            cq_context: std::ptr::null_mut(),
            channel: match channel {
                // SAFETY: reading the raw pointer of a live channel; we keep an Arc to it below.
                Some(ch) => unsafe { ch.comp_channel().as_ptr() },
                None => std::ptr::null_mut(),
            },
            comp_vector: 0,
            wc_flags: sys::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_BYTE_LEN.0 as u64,
            comp_mask: 0,
            flags: 0,
            parent_domain: std::ptr::null_mut(),
        };
        // SAFETY: the context is open for as long as `ctx` lives (we keep a clone), `attr` is a
        // fully initialised ibv_cq_init_attr_ex; a NULL return is handled.
        let raw = unsafe { sys::ibv_create_cq_ex(ctx.context().as_ptr(), &mut attr) };
        let cq = NonNull::new(raw).ok_or_else(|| VerbsError::Other(format!("ibv_create_cq_ex({cqe}): {}", io::Error::last_os_error())))?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let cq =
            Cq { cq, id, next_index: AtomicUsize::new(0), poll_lock: Mutex::new(()), channel: channel.cloned(), _ctx: Arc::clone(ctx) };
        // SAFETY: `cq` points at a live CQ; reading its context's ops table.
        let ops_ok = unsafe {
            let c = cq.cq.as_ref();
            let ex = &*c.context;
            ex.ops.req_notify_cq.is_some() && ex.ops.poll_cq.is_some()
        };
        if !ops_ok {
            return Err(VerbsError::Other("provider lacks ibv_poll_cq or ibv_req_notify_cq".into()));
        }
        Ok(Arc::new(cq))
    }

    /// Claims the next QP index on this CQ (0, 1, 2...), or `None` once index `max` is taken.
    pub(crate) fn claim_index(&self, max: usize) -> Option<usize> {
        self.next_index.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |i| (i <= max).then_some(i + 1)).ok()
    }

    /// The device context the CQ was created in.
    pub(crate) fn context_ptr(&self) -> *mut sys::ibv_context {
        // SAFETY: reading the raw pointer of the context we keep an Arc to.
        unsafe { self._ctx.context().as_ptr() }
    }

    pub(crate) fn as_ibv_cq(&self) -> *mut sys::ibv_cq {
        self.cq.as_ptr().cast()
    }

    /// Arms the CQ: the next completion queues an event on the channel.
    pub fn req_notify(&self) -> io::Result<()> {
        // SAFETY: live CQ; `req_notify_cq` was checked to exist in `new`.
        let rc = unsafe { sys::ibv_req_notify_cq(self.as_ibv_cq(), 0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(rc))
        }
    }

    /// Reads up to `max` completions into `out` with one `ibv_poll_cq`; returns how many.
    ///
    /// Deliberately not the extended `ibv_start_poll`/`ibv_next_poll`/`ibv_end_poll` protocol:
    /// rxe's `cq_next_poll` already publishes the consumer index and unlocks when it returns
    /// ENOENT, so the `ibv_end_poll` the API requires afterwards advances the index past the
    /// producer and replays stale CQEs (seen in the VM as thousands of `wr_id 0` successes).
    pub fn poll(&self, max: usize, out: &mut Vec<RawWc>) -> io::Result<usize> {
        let _g = self.poll_lock.lock().unwrap_or_else(|e| e.into_inner());
        let max = max.clamp(1, 256);
        // SAFETY: ibv_wc is plain old data; all-zero is a valid value.
        let mut wcs: [sys::ibv_wc; 256] = unsafe { std::mem::zeroed() };
        // SAFETY: live CQ; `wcs` has room for `max` entries; polling serialized by `poll_lock`.
        let n = unsafe { sys::ibv_poll_cq(self.as_ibv_cq(), max as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq returned {n}")));
        }
        let n = (n as usize).min(max);
        let me = self.id;
        out.extend(wcs[..n].iter().map(|w| {
            let with_imm = w.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            // SAFETY: reading a u32 out of a union of two u32s (imm_data / invalidated_rkey); the
            // device wrote it when IBV_WC_WITH_IMM is set, and any bit pattern is a valid u32.
            let imm = with_imm.then(|| u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data }));
            RawWc { wr_id: w.wr_id, status: w.status, byte_len: w.byte_len, qp_num: w.qp_num, imm, cq: me }
        }));
        Ok(n)
    }

    /// Reads every pending event from the (non-blocking) channel and acknowledges it. Returns the
    /// number of events, or the error that is not `WouldBlock`.
    pub fn drain_events(&self) -> io::Result<usize> {
        let Some(ch) = &self.channel else { return Ok(0) };
        let mut n = 0;
        loop {
            let mut ev_cq: *mut sys::ibv_cq = std::ptr::null_mut();
            let mut ev_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live (we hold an Arc) and its fd is non-blocking, so this
            // returns -1/EAGAIN instead of blocking when no event is queued.
            let rc = unsafe { sys::ibv_get_cq_event(ch.comp_channel().as_ptr(), &mut ev_cq, &mut ev_ctx) };
            if rc != 0 {
                let err = io::Error::last_os_error();
                return if err.kind() == io::ErrorKind::WouldBlock || n > 0 { Ok(n) } else { Err(err) };
            }
            if !ev_cq.is_null() {
                // SAFETY: ev_cq is the CQ the event was reported for (ours: one CQ per channel);
                // every event must be acked before ibv_destroy_cq, which otherwise blocks.
                unsafe { sys::ibv_ack_cq_events(ev_cq, 1) };
            }
            n += 1;
        }
    }
}

/// Watches `channel`'s fd for readability on the current tokio runtime (a completion event is
/// queued). The returned `AsyncFd` owns an `Arc` of the channel, so the fd stays open for as long
/// as it is registered. Panics, like tokio, when called outside a runtime.
pub fn watch_channel(channel: &Arc<CompletionChannel>) -> io::Result<AsyncFd<Arc<CompletionChannel>>> {
    // SAFETY: the fd is the channel's, opened by ibv_create_comp_channel and closed only by
    // ibv_destroy_comp_channel in the channel's Drop. The AsyncFd owns an Arc of the channel, so
    // the fd stays open (and `as_raw_fd` returns the same fd) until the AsyncFd is dropped and
    // has deregistered it.
    unsafe { AsyncFd::register_with_interest(Arc::clone(channel), tokio::io::Interest::READABLE) }.map_err(io::Error::from)
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc<Cq>, so none is left when this runs; all
        // channel events were acked by `drain_events`.
        let rc = unsafe { sys::ibv_destroy_cq(self.as_ibv_cq()) };
        if rc != 0 {
            tracing::error!(error = %io::Error::from_raw_os_error(rc), "ibv_destroy_cq failed; leaking the CQ");
        }
    }
}
