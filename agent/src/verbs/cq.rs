//! Completion queue (extended CQ) with an optional completion channel.
//!
//! Wrapped here over rdma-mummy-sys rather than sideway because sideway 0.4 has no
//! `ibv_req_notify_cq` / `ibv_get_cq_event` / `ibv_ack_cq_events`, and its CQ `Drop` does
//! `assert_eq!(ibv_destroy_cq(..), 0)`. This wrapper logs a failed destroy instead of panicking.
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::CompletionChannel;
use sideway::ibverbs::device_context::DeviceContext;

use crate::fabric::FabricError;

/// One work completion as read from the CQ (status kept raw: unknown values never panic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawWc {
    pub wr_id: u64,
    pub status: u32,
    pub byte_len: u32,
    /// The QP the completion belongs to (reliable even where a flush's `wr_id` is not).
    pub qp_num: u32,
}

pub(crate) struct Cq {
    cq: NonNull<sys::ibv_cq_ex>,
    /// Serializes `ibv_start_poll`..`ibv_end_poll`, which is not reentrant on one CQ.
    poll_lock: Mutex<()>,
    // Drop order: the CQ is destroyed in `Drop::drop` before these fields are released, so the
    // channel and the context outlive it.
    channel: Option<Arc<CompletionChannel>>,
    _ctx: Arc<DeviceContext>,
}

// SAFETY: libibverbs CQ objects may be used from any thread; the only non-reentrant operation
// (extended polling) is serialized by `poll_lock`, and `ibv_req_notify_cq` is thread-safe.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub fn new(ctx: &Arc<DeviceContext>, cqe: u32, channel: Option<&Arc<CompletionChannel>>) -> Result<Arc<Cq>, FabricError> {
        let mut attr = sys::ibv_cq_init_attr_ex {
            cqe,
            cq_context: std::ptr::null_mut(),
            channel: match channel {
                // SAFETY: reading the raw pointer of a live channel; we keep an Arc to it below.
                Some(ch) => unsafe { ch.comp_channel().as_ptr() },
                None => std::ptr::null_mut(),
            },
            comp_vector: 0,
            wc_flags: (sys::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_BYTE_LEN.0
                | sys::ibv_create_cq_wc_flags::IBV_WC_EX_WITH_QP_NUM.0) as u64,
            comp_mask: 0,
            flags: 0,
            parent_domain: std::ptr::null_mut(),
        };
        // SAFETY: the context is open for as long as `ctx` lives (we keep a clone), `attr` is a
        // fully initialised ibv_cq_init_attr_ex; a NULL return is handled.
        let raw = unsafe { sys::ibv_create_cq_ex(ctx.context().as_ptr(), &mut attr) };
        let cq = NonNull::new(raw)
            .ok_or_else(|| FabricError::Other(format!("ibv_create_cq_ex({cqe}): {}", io::Error::last_os_error())))?;
        let cq = Cq { cq, poll_lock: Mutex::new(()), channel: channel.cloned(), _ctx: Arc::clone(ctx) };
        // SAFETY: `cq` points at a live CQ; reading its context's ops table.
        let ops_ok = unsafe {
            let c = cq.cq.as_ref();
            let ex = &*c.context;
            ex.ops.req_notify_cq.is_some()
                && c.start_poll.is_some()
                && c.next_poll.is_some()
                && c.end_poll.is_some()
                && c.read_byte_len.is_some()
                && c.read_qp_num.is_some()
        };
        if !ops_ok {
            return Err(FabricError::Other("provider lacks extended CQ polling or CQ notification".into()));
        }
        Ok(Arc::new(cq))
    }

    pub fn as_ibv_cq(&self) -> *mut sys::ibv_cq {
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

    /// Reads up to `max` completions into `out`; returns how many were read.
    pub fn poll(&self, max: usize, out: &mut Vec<RawWc>) -> io::Result<usize> {
        let _g = self.poll_lock.lock().unwrap_or_else(|e| e.into_inner());
        let cq = self.cq.as_ptr();
        let mut attr = sys::ibv_poll_cq_attr { comp_mask: 0 };
        // SAFETY: live CQ, polling serialized by `poll_lock`; the function pointers were checked in
        // `new`. Fields of the current completion are read only between a successful
        // start/next_poll and end_poll, as the extended CQ API requires.
        unsafe {
            let rc = sys::ibv_start_poll(cq, &mut attr);
            if rc == libc_enoent() {
                return Ok(0);
            }
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
            let mut n = 0;
            loop {
                let c = &*cq;
                out.push(RawWc {
                    wr_id: c.wr_id,
                    status: c.status,
                    byte_len: sys::ibv_wc_read_byte_len(cq),
                    qp_num: sys::ibv_wc_read_qp_num(cq),
                });
                n += 1;
                if n >= max {
                    break;
                }
                let rc = sys::ibv_next_poll(cq);
                if rc != 0 {
                    // ENOENT = drained; anything else is reported on the next poll.
                    break;
                }
            }
            sys::ibv_end_poll(cq);
            Ok(n)
        }
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

fn libc_enoent() -> i32 {
    nix::libc::ENOENT
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
