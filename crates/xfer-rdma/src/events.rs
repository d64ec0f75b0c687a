//! A device context's asynchronous events (`ibv_get_async_event` / `ibv_ack_async_event`): a
//! port going up or down, the device failing, a QP hitting a fatal error. [`AsyncEvents::wait`]
//! waits for the next one with a timeout (so the thread reading them can be stopped) and hands
//! it back as a plain value, acknowledged.
//!
//! Unsafe lives here because the events are read through the context's raw pointer, the event's
//! element is a C union, and its QP pointer is only valid until the event is acknowledged.
use std::io;
use std::sync::Arc;
use std::time::Duration;

use nix::libc;
use rdma_mummy_sys as sys;
use sideway::ibverbs::device_context::DeviceContext;

/// One asynchronous event, as a value (raw codes never panic: unknown ones are `Other`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncEvent {
    /// IBV_EVENT_PORT_ACTIVE
    PortActive { port: u8 },
    /// IBV_EVENT_PORT_ERR: the link went down.
    PortErr { port: u8 },
    /// IBV_EVENT_DEVICE_FATAL: the device is unusable until it is reset.
    DeviceFatal,
    /// IBV_EVENT_QP_FATAL, _QP_REQ_ERR, _QP_ACCESS_ERR: the QP moved to ERR (`qpn`).
    QpFatal { qpn: u32, code: u32 },
    /// Any other event, by its code.
    Other { code: u32 },
}

/// The async event queue of one device context.
pub struct AsyncEvents {
    ctx: Arc<DeviceContext>,
    fd: libc::c_int,
}

impl AsyncEvents {
    /// Makes the context's async event fd non-blocking, so [`Self::wait`] never blocks past
    /// its timeout.
    pub fn new(ctx: &Arc<DeviceContext>) -> io::Result<AsyncEvents> {
        // SAFETY: the context is open while `ctx` lives (we keep a clone); `async_fd` is a plain
        // int field set when the context was opened and never changed.
        let fd = unsafe { (*ctx.context().as_ptr()).async_fd };
        // SAFETY: fcntl on an fd the context owns and keeps open; only its flags change.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(AsyncEvents { ctx: Arc::clone(ctx), fd })
    }

    /// The next event, waiting at most `timeout` for one (`Ok(None)`: none came).
    pub fn wait(&self, timeout: Duration) -> io::Result<Option<AsyncEvent>> {
        let mut pfd = libc::pollfd { fd: self.fd, events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd for the duration of the call; the fd stays open (the context
        // is alive while `self` is).
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(None) } else { Err(e) };
        }
        if n == 0 {
            return Ok(None);
        }
        self.read()
    }

    /// Reads one event if one is waiting (non-blocking) and acknowledges it.
    fn read(&self) -> io::Result<Option<AsyncEvent>> {
        // SAFETY: ibv_async_event is a plain C struct (a union of pointers and an int, and an
        // enum); all-zero is a valid value, and ibv_get_async_event overwrites it.
        let mut ev: sys::ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open; `ev` is a valid out-parameter. The fd is non-blocking,
        // so this returns -1/EAGAIN instead of waiting when nothing is there.
        let rc = unsafe { sys::ibv_get_async_event(self.ctx.context().as_ptr(), &mut ev) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock { Ok(None) } else { Err(e) };
        }
        // Read as the raw u32 it is in C: a code this build's enum lacks must not become an
        // invalid Rust enum value.
        // SAFETY: `event_type` is a `repr(u32)` enum field, so it is 4 aligned bytes of `ev`.
        let code = unsafe { std::ptr::addr_of!(ev.event_type).cast::<u32>().read() };
        let event = match code {
            9 | 10 => {
                // SAFETY: for port events the union holds the port number.
                let port = unsafe { ev.element.port_num };
                let port = u8::try_from(port).unwrap_or(0);
                if code == 9 {
                    AsyncEvent::PortActive { port }
                } else {
                    AsyncEvent::PortErr { port }
                }
            }
            8 => AsyncEvent::DeviceFatal,
            1..=3 => {
                // SAFETY: for QP events the union holds the QP's pointer, valid until the event
                // is acknowledged below (ibv_destroy_qp waits for that); qp_num never changes.
                let qp = unsafe { ev.element.qp };
                // SAFETY: as above; a null pointer (never seen) reads as QP number 0.
                let qpn = if qp.is_null() { 0 } else { unsafe { (*qp).qp_num } };
                AsyncEvent::QpFatal { qpn, code }
            }
            _ => AsyncEvent::Other { code },
        };
        // SAFETY: `ev` was filled by ibv_get_async_event and is acknowledged exactly once.
        unsafe { sys::ibv_ack_async_event(&mut ev) };
        Ok(Some(event))
    }
}
