//! Cluster credentials: a cluster CA made by `pdserve cluster init`, member certificates it
//! issues, and the mutual-TLS configurations built from them.
//!
//! Layout of a cluster directory:
//!
//! ```text
//! DIR/cluster-name          the cluster's name
//! DIR/ca.crt                the cluster CA certificate (PEM)
//! DIR/ca.key                the CA's private key (PEM, mode 0600) — keep it off member hosts
//! DIR/members/NODE.crt      a member certificate signed by the CA (PEM)
//! DIR/members/NODE.key      its private key (PEM, mode 0600)
//! ```
//!
//! Every connection (control plane and the `quic` transfer backend) is mutual TLS 1.3: each side
//! presents a member certificate and accepts only certificates that chain to its cluster CA. A
//! certificate from another cluster's CA, or none, fails the handshake. Member certificates all
//! carry the DNS name [`MEMBER_SERVER_NAME`], which clients verify.
//!
//! **Node binding.** A member certificate is also bound to its node name by a second DNS
//! subject alternative name, [`node_dns_name`]:
//!
//! - `NODE.node.pdserve` when the node name is one lowercase DNS label (`a-z`, `0-9`, `-`, at
//!   most 63 characters, no `-` at either end), e.g. `decode-0.node.pdserve`;
//! - otherwise the name's UTF-8 bytes in lowercase hex, in labels of at most 62 digits, then
//!   `.x.node.pdserve` (e.g. `Decode_0` → `4465636f64655f30.x.node.pdserve`). DNS names
//!   compare case-insensitively, so names with upper case go this way and `Decode-0` can never
//!   match a certificate of `decode-0`.
//!
//! Node names are at most [`MAX_NODE_NAME_BYTES`] bytes, without control characters, `/` or
//! `\`. (The common name is still the node name, for people reading the certificate.) A side
//! that learns a peer's node name from its greeting checks it against the peer's verified
//! certificate with [`verify_peer_node`] (webpki's subject-name check) and refuses a mismatch;
//! a certificate issued before this binding existed is refused with a message to re-issue it
//! (`pdserve cluster issue DIR NODE`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::error::{Result, TransportError};

/// The DNS name every member certificate carries and every client verifies.
pub const MEMBER_SERVER_NAME: &str = "pdserve-member";
/// ALPN of control-plane connections.
pub const ALPN_CONTROL: &[u8] = b"pdserve-control/1";
/// ALPN of `quic` transfer-backend connections.
pub const ALPN_TRANSFER: &[u8] = b"pdserve-transfer/1";
/// Parent domain of the DNS names that bind member certificates to node names.
pub const NODE_NAME_DOMAIN: &str = "node.pdserve";
/// Label before [`NODE_NAME_DOMAIN`] marking a hex-encoded node name.
const HEX_NODE_LABEL: &str = "x";
/// Hex digits per label of a hex-encoded node name (a DNS label holds at most 63).
const HEX_DIGITS_PER_LABEL: usize = 62;
/// Longest node name a member certificate can be issued for, in bytes.
pub const MAX_NODE_NAME_BYTES: usize = 100;

fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(e.to_string())
}

fn unauthenticated(message: String) -> TransportError {
    TransportError::Unauthenticated(message)
}

/// Checks that `node` can be a member's node name: non-empty, at most [`MAX_NODE_NAME_BYTES`]
/// bytes, without control characters, `/` or `\`.
///
/// # Errors
/// [`TransportError::Config`] naming the problem.
pub fn validate_node_name(node: &str) -> Result<()> {
    if node.is_empty()
        || node.len() > MAX_NODE_NAME_BYTES
        || node
            .chars()
            .any(|c| c.is_control() || c == '/' || c == '\\')
    {
        return Err(TransportError::Config(format!(
            "invalid node name {node:?}: 1 to {MAX_NODE_NAME_BYTES} bytes, without control \
             characters, `/` or `\\`"
        )));
    }
    Ok(())
}

/// Whether `node` is one lowercase DNS label, written as is in its binding name.
fn is_plain_label(node: &str) -> bool {
    let b = node.as_bytes();
    (1..=63).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// The DNS name that binds a member certificate to `node` (see the module docs).
///
/// # Errors
/// [`TransportError::Config`] for an invalid node name ([`validate_node_name`]).
pub fn node_dns_name(node: &str) -> Result<String> {
    validate_node_name(node)?;
    if is_plain_label(node) {
        return Ok(format!("{node}.{NODE_NAME_DOMAIN}"));
    }
    let hex: String = node.bytes().map(|b| format!("{b:02x}")).collect();
    let labels: Vec<&str> = hex
        .as_bytes()
        .chunks(HEX_DIGITS_PER_LABEL)
        .map(|c| std::str::from_utf8(c).expect("hex digits are ASCII"))
        .collect();
    Ok(format!(
        "{}.{HEX_NODE_LABEL}.{NODE_NAME_DOMAIN}",
        labels.join(".")
    ))
}

/// The node name a binding DNS name stands for; `None` for any other name.
fn node_of_dns_name(dns: &str) -> Option<String> {
    let rest = dns
        .to_ascii_lowercase()
        .strip_suffix(NODE_NAME_DOMAIN)?
        .strip_suffix('.')?
        .to_string();
    if let Some(hex) = rest.strip_suffix(&format!(".{HEX_NODE_LABEL}")) {
        let digits: String = hex.split('.').collect();
        let pairs = digits.as_bytes().chunks_exact(2);
        if !pairs.remainder().is_empty() {
            return None;
        }
        let bytes = pairs
            .map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok())
            .collect::<Option<Vec<u8>>>()?;
        return String::from_utf8(bytes).ok();
    }
    (!rest.contains('.')).then_some(rest)
}

/// The node names a certificate is bound to (normally one; none for a certificate issued
/// before node binding existed). For messages only: checks go through [`verify_node`].
pub fn certified_nodes(cert: &CertificateDer<'_>) -> Vec<String> {
    webpki::EndEntityCert::try_from(cert)
        .map(|ee| ee.valid_dns_names().filter_map(node_of_dns_name).collect())
        .unwrap_or_default()
}

/// Checks that a member certificate (already verified against the cluster CA by the TLS
/// handshake) is bound to `node`.
///
/// # Errors
/// [`TransportError::Unauthenticated`]: the certificate does not parse, is bound to another
/// node, or carries no node binding (issued before it existed: re-issue it).
pub fn verify_node(cert: &CertificateDer<'_>, node: &str) -> Result<()> {
    let ee = webpki::EndEntityCert::try_from(cert)
        .map_err(|e| unauthenticated(format!("the certificate of `{node}` does not parse: {e}")))?;
    let expected =
        node_dns_name(node).map_err(|e| unauthenticated(format!("the peer announced {e}")))?;
    let subject = rustls_pki_types::ServerName::try_from(expected.as_str())
        .map_err(|e| unauthenticated(format!("node `{node}`: {expected:?}: {e}")))?;
    if ee.verify_is_valid_for_subject_name(&subject).is_ok() {
        return Ok(());
    }
    let bound = certified_nodes(cert);
    Err(unauthenticated(if bound.is_empty() {
        format!(
            "the certificate presented for node `{node}` is not bound to a node name (issued \
             by a pdserve without node binding): re-issue it with `pdserve cluster issue DIR \
             {node}` and restart that member"
        )
    } else {
        format!(
            "the peer announced node `{node}` but its certificate is issued for node `{}`; a \
             member may only use its own node name",
            bound.join("`, `")
        )
    }))
}

/// The node name the verified certificate `cert` is bound to.
///
/// # Errors
/// [`TransportError::Unauthenticated`] when it is bound to no node (issued before node
/// binding: re-issue it) or to more than one.
pub fn certified_node(cert: &CertificateDer<'_>) -> Result<String> {
    match certified_nodes(cert).as_slice() {
        [node] => {
            verify_node(cert, node)?;
            Ok(node.clone())
        }
        [] => Err(unauthenticated(
            "the peer's certificate is not bound to a node name (issued by a pdserve without \
             node binding): re-issue it with `pdserve cluster issue DIR NODE` and restart that \
             member"
                .into(),
        )),
        many => Err(unauthenticated(format!(
            "the peer's certificate is bound to several node names (`{}`)",
            many.join("`, `")
        ))),
    }
}

/// The end-entity certificate the peer of `conn` presented in the TLS handshake.
///
/// # Errors
/// [`TransportError::Unauthenticated`] when it presented none.
pub fn peer_certificate(conn: &quinn::Connection) -> Result<CertificateDer<'static>> {
    conn.peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .and_then(|chain| chain.into_iter().next())
        .ok_or_else(|| unauthenticated("the peer presented no certificate".into()))
}

/// Checks that the peer of `conn` presented a certificate bound to `node` (the name it
/// announced).
///
/// # Errors
/// As [`peer_certificate`] and [`verify_node`].
pub fn verify_peer_node(conn: &quinn::Connection, node: &str) -> Result<()> {
    verify_node(&peer_certificate(conn)?, node)
}

fn ca_params(cluster: &str) -> Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("pdserve cluster CA {cluster}"));
    params
        .distinguished_name
        .push(DnType::OrganizationName, "pdserve");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(params)
}

/// A cluster's CA: issues member certificates.
#[derive(Clone)]
pub struct ClusterCredentials {
    name: String,
    ca_cert_pem: String,
    ca_key_pem: String,
}

impl std::fmt::Debug for ClusterCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCredentials")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ClusterCredentials {
    /// A new CA held only in memory (tests, benchmarks, single-process tools).
    ///
    /// # Errors
    /// [`TransportError::Tls`] when key or certificate generation fails.
    pub fn ephemeral(cluster: &str) -> Result<Self> {
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = ca_params(cluster)?.self_signed(&key).map_err(tls_err)?;
        Ok(Self {
            name: cluster.to_string(),
            ca_cert_pem: cert.pem(),
            ca_key_pem: key.serialize_pem(),
        })
    }

    /// Loads a cluster CA written by [`init_cluster`].
    ///
    /// # Errors
    /// I/O errors reading the files; [`TransportError::Tls`] when they do not parse.
    pub fn load(dir: &Path) -> Result<Self> {
        let name = std::fs::read_to_string(dir.join("cluster-name"))?
            .trim()
            .to_string();
        let ca_cert_pem = std::fs::read_to_string(dir.join("ca.crt"))?;
        let ca_key_pem = std::fs::read_to_string(dir.join("ca.key"))?;
        KeyPair::from_pem(&ca_key_pem).map_err(tls_err)?;
        Ok(Self {
            name,
            ca_cert_pem,
            ca_key_pem,
        })
    }

    /// The cluster's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The CA certificate (PEM).
    pub fn ca_cert_pem(&self) -> &str {
        &self.ca_cert_pem
    }

    /// Issues a member certificate for `node` (in memory).
    ///
    /// The certificate carries the DNS names [`MEMBER_SERVER_NAME`] and [`node_dns_name`]
    /// (`node`), and `node` as its common name.
    ///
    /// # Errors
    /// [`TransportError::Tls`] when signing fails; [`TransportError::Config`] for an invalid
    /// node name ([`validate_node_name`]).
    pub fn issue(&self, node: &str) -> Result<MemberCredentials> {
        let node_name = node_dns_name(node)?;
        let ca_key = KeyPair::from_pem(&self.ca_key_pem).map_err(tls_err)?;
        // Re-signing the same CA parameters with the same key yields an issuer with the
        // subject and key identifier of the CA on disk, which is all a signature chain needs.
        let ca_cert = ca_params(&self.name)?
            .self_signed(&ca_key)
            .map_err(tls_err)?;
        let mut params = CertificateParams::new(vec![MEMBER_SERVER_NAME.to_string(), node_name])
            .map_err(tls_err)?;
        params.distinguished_name.push(DnType::CommonName, node);
        params.distinguished_name.push(
            DnType::OrganizationName,
            format!("pdserve cluster {}", self.name),
        );
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = params.signed_by(&key, &ca_cert, &ca_key).map_err(tls_err)?;
        MemberCredentials::from_pem(
            &self.name,
            node,
            &self.ca_cert_pem,
            &cert.pem(),
            &key.serialize_pem(),
        )
    }
}

/// Creates a cluster directory: a new CA for `cluster_name` (see the module docs for the
/// layout). Refuses to overwrite an existing CA.
///
/// # Errors
/// [`TransportError::Config`] when `dir` already holds a CA; I/O errors writing files;
/// [`TransportError::Tls`] when generation fails.
pub fn init_cluster(dir: &Path, cluster_name: &str) -> Result<ClusterCredentials> {
    if cluster_name.is_empty() || cluster_name.contains('\n') {
        return Err(TransportError::Config(format!(
            "invalid cluster name {cluster_name:?}"
        )));
    }
    if dir.join("ca.key").exists() {
        return Err(TransportError::Config(format!(
            "{} already holds a cluster CA",
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir.join("members"))?;
    let creds = ClusterCredentials::ephemeral(cluster_name)?;
    std::fs::write(dir.join("cluster-name"), format!("{cluster_name}\n"))?;
    std::fs::write(dir.join("ca.crt"), &creds.ca_cert_pem)?;
    write_private(&dir.join("ca.key"), &creds.ca_key_pem)?;
    tracing::info!(dir = %dir.display(), cluster = cluster_name, "cluster CA created");
    Ok(creds)
}

/// Issues a member certificate for `node_name` with the CA in `dir` and writes it to
/// `dir/members/NODE.crt` and `.key`.
///
/// # Errors
/// As [`ClusterCredentials::load`] and [`ClusterCredentials::issue`], and I/O errors writing.
pub fn issue_member(dir: &Path, node_name: &str) -> Result<MemberCredentials> {
    let cluster = ClusterCredentials::load(dir)?;
    let member = cluster.issue(node_name)?;
    std::fs::create_dir_all(dir.join("members"))?;
    std::fs::write(member_path(dir, node_name, "crt"), &member.cert_pem)?;
    write_private(&member_path(dir, node_name, "key"), &member.key_pem)?;
    Ok(member)
}

fn member_path(dir: &Path, node: &str, ext: &str) -> PathBuf {
    dir.join("members").join(format!("{node}.{ext}"))
}

fn write_private(path: &Path, contents: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(contents.as_bytes())?;
    Ok(())
}

/// One member's identity: its certificate and key, and the cluster CA it trusts.
#[derive(Clone)]
pub struct MemberCredentials {
    cluster: String,
    node: String,
    ca_cert_pem: String,
    cert_pem: String,
    key_pem: String,
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key_pkcs8: Vec<u8>,
}

impl std::fmt::Debug for MemberCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberCredentials")
            .field("cluster", &self.cluster)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl MemberCredentials {
    fn from_pem(
        cluster: &str,
        node: &str,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> Result<Self> {
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(tls_err)?;
        let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(tls_err)?;
        let key = KeyPair::from_pem(key_pem).map_err(tls_err)?;
        Ok(Self {
            cluster: cluster.to_string(),
            node: node.to_string(),
            ca_cert_pem: ca_pem.to_string(),
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
            ca,
            cert,
            key_pkcs8: key.serialize_der(),
        })
    }

    /// Loads the member `node` from a cluster directory (needs `cluster-name`, `ca.crt` and
    /// `members/NODE.{crt,key}`; not the CA key).
    ///
    /// A certificate that is not bound to `node` loads, with a warning: peers refuse it when
    /// this member announces `node` (see the module docs).
    ///
    /// # Errors
    /// I/O errors reading; [`TransportError::Tls`] when a file does not parse.
    pub fn load(dir: &Path, node: &str) -> Result<Self> {
        let cluster = std::fs::read_to_string(dir.join("cluster-name"))?
            .trim()
            .to_string();
        let ca = std::fs::read_to_string(dir.join("ca.crt"))?;
        let cert = std::fs::read_to_string(member_path(dir, node, "crt"))?;
        let key = std::fs::read_to_string(member_path(dir, node, "key"))?;
        let member = Self::from_pem(&cluster, node, &ca, &cert, &key)?;
        if let Err(e) = verify_node(&member.cert, node) {
            tracing::warn!(
                file = %member_path(dir, node, "crt").display(),
                error = %e,
                "member certificate is not bound to its node name: other members will refuse it"
            );
        }
        Ok(member)
    }

    /// The cluster name.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// The node name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The CA certificate this member trusts (PEM).
    pub fn ca_cert_pem(&self) -> &str {
        &self.ca_cert_pem
    }

    fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_pkcs8.clone()))
    }

    fn roots(&self) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).map_err(tls_err)?;
        Ok(roots)
    }

    /// A rustls server configuration that demands a client certificate from this cluster.
    ///
    /// # Errors
    /// [`TransportError::Tls`] when the credentials are unusable.
    pub fn server_tls(&self, alpn: &[u8]) -> Result<rustls::ServerConfig> {
        let provider = provider();
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()?), provider.clone())
                .build()
                .map_err(tls_err)?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.cert.clone()], self.key())
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }

    /// A rustls client configuration that presents this member's certificate and accepts
    /// only servers of this cluster.
    ///
    /// # Errors
    /// [`TransportError::Tls`] when the credentials are unusable.
    pub fn client_tls(&self, alpn: &[u8]) -> Result<rustls::ClientConfig> {
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(vec![self.cert.clone()], self.key())
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Ok(cfg)
    }

    /// A quinn endpoint bound to `addr` that accepts members of this cluster and connects to
    /// them (both directions mutual TLS).
    ///
    /// # Errors
    /// TLS and I/O errors. Must be called inside a tokio runtime.
    pub fn quic_endpoint(
        &self,
        addr: std::net::SocketAddr,
        alpn: &[u8],
        transport: Arc<quinn::TransportConfig>,
    ) -> Result<quinn::Endpoint> {
        let socket = quinn::default_runtime()
            .ok_or_else(|| TransportError::Config("no async runtime for QUIC".into()))?
            .wrap_udp_socket(std::net::UdpSocket::bind(addr)?)?;
        self.quic_endpoint_on(socket, alpn, transport, quinn::EndpointConfig::default())
    }

    /// As [`MemberCredentials::quic_endpoint`], on a socket the caller prepared (buffer sizes,
    /// a wrapper of its own over [`quinn::Runtime::wrap_udp_socket`])
    /// and with its endpoint settings (largest UDP payload).
    ///
    /// # Errors
    /// TLS and I/O errors. Must be called inside a tokio runtime.
    pub fn quic_endpoint_on(
        &self,
        socket: Arc<dyn quinn::AsyncUdpSocket>,
        alpn: &[u8],
        transport: Arc<quinn::TransportConfig>,
        endpoint: quinn::EndpointConfig,
    ) -> Result<quinn::Endpoint> {
        let server_crypto =
            quinn::crypto::rustls::QuicServerConfig::try_from(self.server_tls(alpn)?)
                .map_err(tls_err)?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server.transport_config(transport.clone());
        let client_crypto =
            quinn::crypto::rustls::QuicClientConfig::try_from(self.client_tls(alpn)?)
                .map_err(tls_err)?;
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(transport);
        let runtime = quinn::default_runtime()
            .ok_or_else(|| TransportError::Config("no async runtime for QUIC".into()))?;
        let mut endpoint =
            quinn::Endpoint::new_with_abstract_socket(endpoint, Some(server), socket, runtime)?;
        endpoint.set_default_client_config(client);
        Ok(endpoint)
    }
}

/// The crypto provider of cluster connections (ring), passed explicitly so no process-wide
/// default has to be installed.
///
/// Its TLS 1.3 suites prefer AES-128-GCM (TLS 1.3's mandatory suite) over ring's default
/// AES-256-GCM: every `quic` transfer byte is sealed once and opened once, and on the
/// reference machine AES-128-GCM costs 0.100 CPU-s/GB against 0.113–0.116 for AES-256-GCM
/// (64 KB packets, ring's VAES path). The key exchange (X25519 or P-256) gives 128-bit
/// security, so the longer key added none to these connections. AES-256-GCM and
/// ChaCha20-Poly1305 stay offered, after it.
pub fn provider() -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

/// QUIC transport settings shared by the control plane and the `quic` backend: idle timeout
/// (a silent peer is gone after it), keep-alives at a third of it, and flow-control windows
/// large enough for bulk transfers.
pub fn quic_transport(idle: Duration) -> Result<Arc<quinn::TransportConfig>> {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(idle).map_err(|e| TransportError::Config(e.to_string()))?,
    ));
    t.keep_alive_interval(Some(idle / 3));
    t.stream_receive_window(quinn::VarInt::from_u32(16 << 20));
    t.receive_window(quinn::VarInt::from_u32(256 << 20));
    t.send_window(256 << 20);
    t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(1024));
    t.max_concurrent_uni_streams(quinn::VarInt::from_u32(1024));
    Ok(Arc::new(t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_cluster_writes_ca_and_issues_loadable_members() {
        let dir = tempfile::tempdir().unwrap();
        let ca = init_cluster(dir.path(), "alpha").unwrap();
        assert_eq!(ca.name(), "alpha");
        assert!(
            init_cluster(dir.path(), "alpha").is_err(),
            "must not overwrite a CA"
        );
        let m = issue_member(dir.path(), "prefill-0").unwrap();
        let loaded = MemberCredentials::load(dir.path(), "prefill-0").unwrap();
        assert_eq!(loaded.cluster(), "alpha");
        assert_eq!(loaded.node(), "prefill-0");
        assert_eq!(loaded.cert, m.cert);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        loaded.server_tls(ALPN_CONTROL).unwrap();
        loaded.client_tls(ALPN_CONTROL).unwrap();
    }

    /// Runs a TLS 1.3 handshake between two members in memory; returns the suite agreed.
    fn handshake(
        client: rustls::ClientConfig,
        server: rustls::ServerConfig,
    ) -> rustls::CipherSuite {
        let name = rustls_pki_types::ServerName::try_from(MEMBER_SERVER_NAME).unwrap();
        let mut c = rustls::ClientConnection::new(Arc::new(client), name).unwrap();
        let mut s = rustls::ServerConnection::new(Arc::new(server)).unwrap();
        for _ in 0..10 {
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut buf.as_slice()).unwrap();
            s.process_new_packets().unwrap();
            let mut buf = Vec::new();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut buf.as_slice()).unwrap();
            c.process_new_packets().unwrap();
        }
        assert!(
            !c.is_handshaking() && !s.is_handshaking(),
            "handshake did not finish"
        );
        let suite = c.negotiated_cipher_suite().unwrap().suite();
        assert_eq!(s.negotiated_cipher_suite().unwrap().suite(), suite);
        suite
    }

    #[test]
    fn members_agree_on_aes_128_gcm_and_still_accept_a_peer_that_wants_aes_256() {
        let ca = ClusterCredentials::ephemeral("alpha").unwrap();
        let (a, b) = (
            ca.issue("prefill-0").unwrap(),
            ca.issue("decode-0").unwrap(),
        );
        assert_eq!(
            handshake(
                a.client_tls(ALPN_TRANSFER).unwrap(),
                b.server_tls(ALPN_TRANSFER).unwrap()
            ),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
        // A client built on ring's default order (as before this preference) still connects:
        // the server follows the client's order among the suites both offer.
        let old = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(a.roots().unwrap())
        .with_client_auth_cert(vec![a.cert.clone()], a.key())
        .unwrap();
        let mut old = old;
        old.alpn_protocols = vec![ALPN_TRANSFER.to_vec()];
        assert_eq!(
            handshake(old, b.server_tls(ALPN_TRANSFER).unwrap()),
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384
        );
    }

    fn message(e: TransportError) -> String {
        match e {
            TransportError::Unauthenticated(m) => m,
            other => panic!("expected Unauthenticated, got {other:?}"),
        }
    }

    #[test]
    fn a_certificate_issued_for_a_node_verifies_as_that_node_only() {
        let ca = ClusterCredentials::ephemeral("alpha").unwrap();
        let a = ca.issue("decode-0").unwrap();
        verify_node(&a.cert, "decode-0").unwrap();
        assert_eq!(certified_nodes(&a.cert), vec!["decode-0".to_string()]);
        for other in [
            "decode-1",
            "Decode-0",
            "decode-0.node.pdserve",
            "decode",
            "prober",
        ] {
            let m = message(verify_node(&a.cert, other).unwrap_err());
            assert!(m.contains("issued for node `decode-0`"), "{other}: {m}");
        }
        // Names outside one lowercase DNS label are bound in hex, exactly.
        for node in [
            "Decode-0",
            "prefill_0",
            "gpu.host-3",
            "ünïcode",
            "x",
            "-dash-",
        ] {
            let m = ca.issue(node).unwrap();
            verify_node(&m.cert, node).unwrap();
            assert_eq!(certified_nodes(&m.cert), vec![node.to_string()], "{node}");
            verify_node(&a.cert, node).unwrap_err();
            verify_node(&m.cert, "decode-0").unwrap_err();
        }
        let long = "n".repeat(MAX_NODE_NAME_BYTES);
        let m = ca.issue(&long.to_uppercase()).unwrap();
        verify_node(&m.cert, &long.to_uppercase()).unwrap();
        verify_node(&m.cert, &long).unwrap_err();
        assert!(ca.issue(&format!("{long}n")).is_err());
        assert!(ca.issue("a/b").is_err());
        assert!(ca.issue("").is_err());
    }

    #[test]
    fn a_certificate_without_node_binding_is_refused_with_a_reissue_hint() {
        // A member certificate as issued before node binding: only `MEMBER_SERVER_NAME`.
        let ca_key = KeyPair::generate().unwrap();
        let ca_cert = ca_params("alpha").unwrap().self_signed(&ca_key).unwrap();
        let mut params = CertificateParams::new(vec![MEMBER_SERVER_NAME.to_string()]).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "decode-0");
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca_cert, &ca_key).unwrap();
        let der = CertificateDer::from(cert.der().to_vec());
        assert!(certified_nodes(&der).is_empty());
        let m = message(verify_node(&der, "decode-0").unwrap_err());
        assert!(
            m.contains("not bound to a node name")
                && m.contains("pdserve cluster issue DIR decode-0"),
            "{m}"
        );
    }
}
