//! Data-plane TLS streams over loopback through [`super`]'s handshake and hand-over, with the
//! kernel's answer set by each test: no kTLS at all, a kernel that lacks the negotiated suite
//! (rustls on the record-at-a-time socket), and one whose probe accepted the suite (on a kernel
//! with the `tls` module the stream goes to the kernel; without it the hand-over fails that
//! stream, and later streams stay with rustls). In every case that yields a stream, what the
//! initiator writes right after its halves are made (the hello) arrives, and 1 MiB goes each
//! way intact.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ::ktls::{CompatibleCiphers, CompatibleCiphersForVersion};
use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType};
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OnceCell;

use super::{accept_with, connect_with, Handshaken, KernelState, Stream, Support};
use crate::identity::tls::{data_tls, DataTls, KernelTls};
use crate::identity::{Role, RolePolicy};

/// A CA and one node certificate it signed (valid for 127.0.0.1), as both ends' data-plane TLS;
/// with `tls12_client`, the initiator offers TLS 1.2 only.
fn node_tls_with(tls12_client: bool) -> DataTls {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(Vec::<String>::new()).unwrap();
    leaf.subject_alt_names =
        vec![SanType::URI("spiffe://xfer.test/xfer/node/n1".try_into().unwrap()), SanType::IpAddress("127.0.0.1".parse().unwrap())];
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let policy = Arc::new(RolePolicy::new("xfer.test", &[]));
    let (chain, roots) = (vec![cert.der().clone()], vec![ca_cert.der().clone()]);
    let mut tls = data_tls(chain.clone(), key.clone_key(), roots.clone(), policy, None, KernelTls::Auto).unwrap();
    if tls12_client {
        let mut store = rustls::RootCertStore::empty();
        store.add(roots[0].clone()).unwrap();
        let mut client = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS12])
            .unwrap()
            .with_root_certificates(store)
            .with_client_auth_cert(chain, key)
            .unwrap();
        client.enable_secret_extraction = true;
        tls.client = Arc::new(client);
    }
    tls
}

fn node_tls() -> DataTls {
    node_tls_with(false)
}

/// A kernel whose answer is `support` (no probe), for the life of the test process.
fn kernel(support: Support) -> &'static KernelState {
    let k = KernelState::new();
    let k = KernelState { support: OnceCell::new_with(Some(support)), ..k };
    Box::leak(Box::new(k))
}

fn ciphers(tls12: bool, tls13: bool) -> Support {
    let of = |on: bool| CompatibleCiphersForVersion { aes_gcm_128: on, aes_gcm_256: on, chacha20_poly1305: on };
    Support::Ciphers(CompatibleCiphers { tls12: of(tls12), tls13: of(tls13) })
}

/// Both ends' handshakes over one loopback connection.
async fn handshake(kernel: &'static KernelState, tls: &DataTls) -> (Handshaken, Handshaken) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let (c, s) = tokio::join!(async { connect_with(kernel, tls, name, TcpStream::connect(addr).await?).await }, async {
        accept_with(kernel, tls, listener.accept().await?.0).await
    });
    (c.expect("initiator's handshake"), s.expect("target's handshake"))
}

/// Each end's identity from the rustls session: a node.
fn assert_nodes(tls: &DataTls, ends: [&Handshaken; 2]) {
    for end in ends {
        assert_eq!(tls.caller_of(end.peer_certificates()).expect("a verified peer").role, Role::Node);
    }
}

/// Makes both ends' halves; the initiator sends a 5-byte hello at once, then 1 MiB each way.
async fn exchange(c: Handshaken, s: Handshaken) -> (io::Result<()>, io::Result<()>) {
    let big: Vec<u8> = (0..1usize << 20).map(|i| (i * 31 % 251) as u8).collect();
    let initiator = async {
        let (mut rd, mut wr) = c.into_halves().await?;
        wr.write_all(b"hello").await?;
        wr.write_all(&big).await?;
        wr.flush().await?;
        let mut back = vec![0u8; big.len()];
        rd.read_exact(&mut back).await?;
        assert!(back == big, "the target's bytes differ");
        wr.shutdown().await?;
        Ok(())
    };
    let target = async {
        let (mut rd, mut wr) = s.into_halves().await?;
        let mut hello = [0u8; 5];
        rd.read_exact(&mut hello).await?;
        assert_eq!(&hello, b"hello");
        let mut got = vec![0u8; big.len()];
        rd.read_exact(&mut got).await?;
        assert!(got == big, "the initiator's bytes differ");
        wr.write_all(&got).await?;
        wr.flush().await?;
        // The initiator's shutdown (close_notify) ends the stream cleanly.
        assert_eq!(rd.read(&mut [0u8; 1]).await?, 0);
        Ok(())
    };
    tokio::join!(initiator, target)
}

#[tokio::test]
async fn without_kernel_tls_auto_streams_are_rustls_on_the_buffered_socket() {
    let tls = node_tls();
    let k = kernel(Support::None("no tls module".into()));
    let (c, s) = handshake(k, &tls).await;
    assert!(matches!((&c.stream, &s.stream), (Stream::ClientUser(_), Stream::ServerUser(_))));
    assert_nodes(&tls, [&c, &s]);
    let (i, t) = exchange(c, s).await;
    i.expect("initiator");
    t.expect("target");
    assert!(k.warned.load(Ordering::Acquire), "the fallback was not said");
}

#[tokio::test]
async fn a_suite_the_kernel_lacks_stays_with_rustls_on_the_record_at_a_time_socket() {
    let tls = node_tls();
    // Our configs negotiate TLS 1.3; this kernel takes TLS 1.2 ciphers only.
    let k = kernel(ciphers(true, false));
    let (c, s) = handshake(k, &tls).await;
    assert!(matches!((&c.stream, &s.stream), (Stream::ClientCorked(_), Stream::ServerCorked(_))));
    assert_nodes(&tls, [&c, &s]);
    let (i, t) = exchange(c, s).await;
    i.expect("initiator");
    t.expect("target");
    assert!(k.warned.load(Ordering::Acquire) && !k.refused.load(Ordering::Acquire));
}

#[tokio::test]
async fn a_kernel_that_takes_the_suite_gets_the_stream_or_refuses_it_once() {
    kernel_gets_the_stream_or_refuses_it_once(node_tls(), "TLS 1.3").await;
}

/// The same with a TLS 1.2 initiator (an ECDHE-ECDSA AES-GCM suite): on a kernel without TLS 1.2
/// ciphers it stays with rustls, on one with them it goes the TLS 1.3 stream's ways.
#[tokio::test]
async fn tls12_streams_stay_with_rustls_or_go_to_the_kernel_the_same_ways() {
    let tls = node_tls_with(true);
    let k = kernel(ciphers(false, true));
    let (c, s) = handshake(k, &tls).await;
    assert_nodes(&tls, [&c, &s]);
    assert!(matches!((&c.stream, &s.stream), (Stream::ClientCorked(_), Stream::ServerCorked(_))));
    if let Stream::ClientCorked(s) = &c.stream {
        assert_eq!(s.get_ref().1.protocol_version(), Some(rustls::ProtocolVersion::TLSv1_2));
    }
    let (i, t) = exchange(c, s).await;
    i.expect("initiator");
    t.expect("target");
    assert!(!k.refused.load(Ordering::Acquire));
    kernel_gets_the_stream_or_refuses_it_once(tls, "TLS 1.2").await;
}

async fn kernel_gets_the_stream_or_refuses_it_once(tls: DataTls, version: &str) {
    let k = kernel(ciphers(true, true));
    let (c, s) = handshake(k, &tls).await;
    assert!(matches!((&c.stream, &s.stream), (Stream::ClientCorked(_), Stream::ServerCorked(_))));
    assert_nodes(&tls, [&c, &s]);
    let (i, t) = exchange(c, s).await;
    let has_tls = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp").is_ok_and(|u| u.split_whitespace().any(|u| u == "tls"));
    if has_tls {
        // The kernel runs both ends' records: the hello and the bytes went through it.
        i.unwrap_or_else(|e| panic!("{version} initiator: {e}"));
        t.unwrap_or_else(|e| panic!("{version} target: {e}"));
        assert!(!k.refused.load(Ordering::Acquire));
        return;
    }
    // No tls module: the hand-over fails both ends' streams (the keys are out of rustls by
    // then), and the next stream stays with rustls without trying.
    let (i, t) = (i.expect_err("initiator handed over"), t.expect_err("target handed over"));
    for e in [&i, &t] {
        assert!(e.to_string().contains("handing the stream's TLS to the kernel failed"), "{e}");
    }
    assert!(k.refused.load(Ordering::Acquire));
    let (c, s) = handshake(k, &tls).await;
    assert!(matches!((&c.stream, &s.stream), (Stream::ClientUser(_), Stream::ServerUser(_))));
    let (i, t) = exchange(c, s).await;
    i.expect("initiator after the refusal");
    t.expect("target after the refusal");
}

/// Both ends' handshakes over one loopback connection whose sockets have the smallest buffers
/// the kernel allows, so what a writer can hand over while its peer reads nothing is almost
/// all user space.
async fn handshake_small_buffers(kernel: &'static KernelState, tls: &DataTls) -> (Handshaken, Handshaken) {
    let small = |s: &tokio::net::TcpSocket| {
        s.set_send_buffer_size(1).unwrap();
        s.set_recv_buffer_size(1).unwrap();
    };
    let listen = tokio::net::TcpSocket::new_v4().unwrap();
    small(&listen); // accepted sockets take the listener's sizes
    listen.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listen.local_addr().unwrap();
    let listener = listen.listen(1).unwrap();
    let client = tokio::net::TcpSocket::new_v4().unwrap();
    small(&client);
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let (c, s) = tokio::join!(async { connect_with(kernel, tls, name, client.connect(addr).await?).await }, async {
        accept_with(kernel, tls, listener.accept().await?.0).await
    });
    (c.expect("initiator's handshake"), s.expect("target's handshake"))
}

/// Bytes `wr` takes, 16 KiB at a time, before a write would wait (polled without waiting).
fn taken_before_waiting(wr: &mut crate::tcp::qp::BoxWrite, limit: usize) -> usize {
    let chunk = vec![0x5au8; 16 << 10];
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut taken = 0;
    while taken < limit {
        match std::pin::Pin::new(&mut *wr).poll_write(&mut cx, &chunk) {
            std::task::Poll::Ready(Ok(n)) if n > 0 => taken += n,
            _ => break,
        }
    }
    taken
}

/// A peer that reads nothing: a rustls stream's writer takes about its send buffer
/// ([`SEND_BUFFER`], not rustls's 64 KiB default, and never unbounded) and then waits, on the
/// initiator's side and on the target's (where an unread stream is then closed by the stall
/// timer, `serve.rs`). The sockets' own buffers are the kernel's smallest.
#[tokio::test]
async fn a_rustls_writer_holds_at_most_its_send_buffer_for_a_peer_that_reads_nothing() {
    use crate::identity::tls::SEND_BUFFER;
    let tls = node_tls();
    let k = kernel(Support::None("no tls module".into()));
    let (c, s) = handshake_small_buffers(k, &tls).await;
    let ((_c_rd, mut c_wr), (_s_rd, mut s_wr)) = (c.into_halves().await.unwrap(), s.into_halves().await.unwrap());
    for (side, wr) in [("initiator", &mut c_wr), ("target", &mut s_wr)] {
        let taken = taken_before_waiting(wr, 64 << 20);
        // The kernel's smallest socket buffers and a few records in flight hold well under
        // 256 KiB on loopback; 64 MiB would mean no bound at all.
        assert!(taken >= SEND_BUFFER - (32 << 10), "{side}: only {taken} bytes before waiting (rustls's default buffer?)");
        assert!(taken <= SEND_BUFFER + (256 << 10), "{side}: {taken} bytes taken for a peer that reads nothing");
    }
}
