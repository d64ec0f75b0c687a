//! What the agent checks of its TLS files at start, so that a wrong file is a start-up error
//! naming the file and the fix (exit 64), not a "broken pipe" every caller sees later: the key is
//! the certificate's, `tls.ca` is a CA and not a leaf, and the agent's own certificate chains to
//! that CA with the uses it is put to (it serves callers and calls peers, so it must verify as a
//! client certificate, and as a server certificate for `tls.server_name` when one is set). The
//! node role is checked by the caller ([`super::tls::TlsMaterial::load`]).
use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier;
use rustls::{CertificateError, Error as RustlsError};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// One failed check: the config key of the file to fix and what is wrong with it.
#[derive(Debug, PartialEq, Eq)]
pub struct Finding {
    pub key: &'static str,
    pub detail: String,
}

fn finding(key: &'static str, detail: String) -> Finding {
    Finding { key, detail }
}

/// The files as read, and their paths for the messages.
pub struct Files<'a> {
    pub chain: &'a [CertificateDer<'static>],
    pub key: &'a PrivateKeyDer<'static>,
    pub roots: &'a [CertificateDer<'static>],
    pub cert_path: &'a str,
    pub ca_path: &'a str,
    pub server_name: Option<&'a str>,
}

/// Runs every check in the order a mistake is best explained: the CA first (a leaf given as
/// `tls.ca` would otherwise read as "unknown issuer"), then the key, then the chain.
pub fn check(f: &Files<'_>) -> Result<(), Finding> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    check_ca(f.roots)?;
    check_key(f, &provider)?;
    check_chain(f, &provider)
}

/// Every certificate in `tls.ca` must be a CA (basicConstraints CA:TRUE).
fn check_ca(roots: &[CertificateDer<'static>]) -> Result<(), Finding> {
    for der in roots {
        let (_, cert) =
            x509_parser::parse_x509_certificate(der).map_err(|e| finding("tls.ca", format!("a certificate in it does not parse: {e}")))?;
        if !cert.is_ca() {
            return Err(finding(
                "tls.ca",
                format!(
                    "holds {}, a leaf, not a CA certificate (no basicConstraints CA:TRUE): tls.ca takes the CA that \
                     issued the agents' and clients' certificates (ca.crt from scripts/make-certs), not a node's own \
                     certificate",
                    subject_of(&cert)
                ),
            ));
        }
    }
    Ok(())
}

fn subject_of(cert: &x509_parser::certificate::X509Certificate<'_>) -> String {
    let s = cert.subject().to_string();
    if s.is_empty() {
        "a certificate with an empty subject".to_string()
    } else {
        format!("\"{s}\"")
    }
}

/// The private key must be the one the certificate was issued for.
fn check_key(f: &Files<'_>, provider: &Arc<rustls::crypto::CryptoProvider>) -> Result<(), Finding> {
    match rustls::sign::CertifiedKey::from_der(f.chain.to_vec(), f.key.clone_key(), provider) {
        Ok(_) => Ok(()),
        Err(RustlsError::InconsistentKeys(_)) => Err(finding(
            "tls.key",
            format!(
                "does not match the certificate in tls.cert ({}): its public key is another one; give the key that was made \
                 with that certificate (NAME.key next to NAME.crt from scripts/make-certs)",
                f.cert_path
            ),
        )),
        Err(e) => Err(finding("tls.key", format!("unusable with tls.cert ({}): {e}", f.cert_path))),
    }
}

/// The agent's certificate chains to the CA as a client certificate (it calls peers) and, for
/// `tls.server_name` if set, as a server certificate (peers verify it under that name).
fn check_chain(f: &Files<'_>, provider: &Arc<rustls::crypto::CryptoProvider>) -> Result<(), Finding> {
    let mut store = rustls::RootCertStore::empty();
    for c in f.roots {
        store.add(c.clone()).map_err(|e| finding("tls.ca", format!("not usable as a trust anchor: {e}")))?;
    }
    let store = Arc::new(store);
    let Some((leaf, intermediates)) = f.chain.split_first() else {
        return Err(finding("tls.cert", "no PEM CERTIFICATE block".into()));
    };
    let now = UnixTime::now();
    let client = rustls::server::WebPkiClientVerifier::builder_with_provider(store.clone(), provider.clone())
        .build()
        .map_err(|e| finding("tls.ca", format!("not usable to verify certificates: {e}")))?;
    client.verify_client_cert(leaf, intermediates, now).map_err(|e| chain_finding(f, &e, "clientAuth"))?;
    if let Some(name) = f.server_name {
        let server_name = ServerName::try_from(name.to_string())
            .map_err(|e| finding("tls.server_name", format!("{name:?} is not a DNS name or IP address: {e}")))?;
        let server = rustls::client::WebPkiServerVerifier::builder_with_provider(store, provider.clone())
            .build()
            .map_err(|e| finding("tls.ca", format!("not usable to verify certificates: {e}")))?;
        server.verify_server_cert(leaf, intermediates, &server_name, &[], now).map_err(|e| match e {
            RustlsError::InvalidCertificate(CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. }) => {
                finding(
                    "tls.server_name",
                    format!(
                        "{name:?} is not a name tls.cert ({}) carries: peers verify this agent's certificate under \
                         tls.server_name, so it must be one of its DNS or IP SANs (scripts/make-certs --dns {name})",
                        f.cert_path
                    ),
                )
            }
            e => chain_finding(f, &e, "serverAuth"),
        })?;
    }
    Ok(())
}

fn chain_finding(f: &Files<'_>, e: &RustlsError, usage: &str) -> Finding {
    let ca = f.ca_path;
    let detail = match e {
        // A CA of the same name but another key reads as a bad signature.
        RustlsError::InvalidCertificate(CertificateError::UnknownIssuer | CertificateError::BadSignature) => format!(
            "does not chain to tls.ca ({ca}): it was issued by another CA ({e}); give the CA that signed it, or a \
             certificate issued by this CA"
        ),
        RustlsError::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
            format!("has expired ({e}); issue a new one")
        }
        RustlsError::InvalidCertificate(CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. }) => {
            format!("is not valid yet ({e}): check this host's clock")
        }
        RustlsError::InvalidCertificate(CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. }) => {
            format!(
                "lacks the {usage} extended key usage: an agent's certificate serves callers and calls peers, so it \
                 needs both serverAuth and clientAuth (scripts/make-certs issues node certificates so)"
            )
        }
        e => format!("does not verify against tls.ca ({ca}): {e}"),
    };
    finding("tls.cert", detail)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, SanType};
    use rustls_pki_types::pem::PemObject;

    fn ca() -> (Issuer<'static, KeyPair>, CertificateDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, "test CA");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = p.self_signed(&key).unwrap();
        (Issuer::new(p, key), cert.der().clone())
    }

    fn leaf(ca: &Issuer<'_, KeyPair>, eku: Vec<ExtendedKeyUsagePurpose>) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, "node-a");
        p.subject_alt_names = vec![SanType::DnsName("node-a".try_into().unwrap())];
        p.extended_key_usages = eku;
        let cert = p.signed_by(&key, ca).unwrap();
        (cert.der().clone(), PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap())
    }

    fn run(
        chain: &[CertificateDer<'static>],
        key: &PrivateKeyDer<'static>,
        roots: &[CertificateDer<'static>],
        name: Option<&str>,
    ) -> Result<(), Finding> {
        check(&Files { chain, key, roots, cert_path: "node.crt", ca_path: "ca.crt", server_name: name })
    }

    const BOTH: [ExtendedKeyUsagePurpose; 2] = [ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];

    #[test]
    fn good_files_pass() {
        let (issuer, ca_der) = ca();
        let (cert, key) = leaf(&issuer, BOTH.to_vec());
        run(&[cert], &key, &[ca_der], Some("node-a")).unwrap();
    }

    #[test]
    fn a_leaf_as_the_ca_is_named() {
        let (issuer, _) = ca();
        let (cert, key) = leaf(&issuer, BOTH.to_vec());
        let one = std::slice::from_ref(&cert);
        let e = run(one, &key, one, None).unwrap_err();
        assert_eq!(e.key, "tls.ca");
        assert!(e.detail.contains("a leaf, not a CA certificate") && e.detail.contains("node-a"), "{}", e.detail);
    }

    #[test]
    fn a_key_of_another_certificate_is_named() {
        let (issuer, ca_der) = ca();
        let (cert, _) = leaf(&issuer, BOTH.to_vec());
        let (_, other_key) = leaf(&issuer, BOTH.to_vec());
        let e = run(&[cert], &other_key, &[ca_der], None).unwrap_err();
        assert_eq!(e.key, "tls.key");
        assert!(e.detail.contains("does not match the certificate in tls.cert (node.crt)"), "{}", e.detail);
    }

    #[test]
    fn another_ca_wrong_usage_and_wrong_server_name_are_named() {
        let (issuer, ca_der) = ca();
        let (_, other_ca) = ca();
        let (cert, key) = leaf(&issuer, BOTH.to_vec());
        let e = run(std::slice::from_ref(&cert), &key, &[other_ca], None).unwrap_err();
        assert_eq!(e.key, "tls.cert");
        assert!(e.detail.contains("does not chain to tls.ca (ca.crt)"), "{}", e.detail);
        let e = run(&[cert], &key, std::slice::from_ref(&ca_der), Some("xfer-agent.xfer-system.svc")).unwrap_err();
        assert_eq!(e.key, "tls.server_name");
        assert!(e.detail.contains("is not a name tls.cert (node.crt) carries"), "{}", e.detail);
        let (server_only, key) = leaf(&issuer, vec![ExtendedKeyUsagePurpose::ServerAuth]);
        let e = run(&[server_only], &key, &[ca_der], None).unwrap_err();
        assert!(e.detail.contains("lacks the clientAuth extended key usage"), "{}", e.detail);
    }
}
