//! The test process's own resources: its descriptor limit, an agent's open descriptors and
//! `/proc` status fields, a flood of idle HTTP/2 connections, and a loopback port that refuses
//! connections.

/// Lets this test process hold thousands of sockets (soft RLIMIT_NOFILE up to the hard limit).
pub fn raise_own_nofile() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

/// A number field of `/proc/<pid>/status` (`Threads:`, `VmRSS:`, `VmHWM:`, `RssAnon:`; the
/// memory ones in KiB).
pub fn proc_status(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in {status}"));
    line[field.len()..].split_whitespace().next().unwrap().parse().unwrap()
}

/// Open descriptors of process `pid`.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// Floods a control listener of the agent `pid` with idle HTTP/2 connections made by `connect`
/// (each sends the client preface and an empty SETTINGS frame, and is held once the server
/// answers with its SETTINGS) until the agent refuses one (closes it at once: the preface may
/// already meet EPIPE or a reset) or its descriptors reach `nofile`. Returns the sockets held
/// and whether one was refused.
pub fn flood_h2<S: std::io::Read + std::io::Write>(pid: u32, nofile: u64, mut connect: impl FnMut() -> S) -> (Vec<S>, bool) {
    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    let mut held = Vec::new();
    while open_fds(pid) + 1 < nofile as usize {
        let mut s = connect();
        let mut h = [0u8; 9];
        if s.write_all(&preface).is_err() || s.read_exact(&mut h).is_err() {
            return (held, true);
        }
        assert_eq!(h[3], 4, "SETTINGS");
        held.push(s);
    }
    (held, false)
}

/// A loopback port that is bound (so nobody else can take it) but not listening: a connection to
/// it is refused at once. The port stays reserved until this is dropped.
pub struct ClosedPort {
    _socket: tokio::net::TcpSocket,
    pub addr: std::net::SocketAddr,
}

pub fn closed_port() -> ClosedPort {
    // No SO_REUSEADDR: a listener bound with it (as std's and tokio's are) cannot share the port.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    ClosedPort { _socket: socket, addr }
}
