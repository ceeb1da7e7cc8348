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
//! carry the DNS name [`MEMBER_SERVER_NAME`], which clients verify; the node name is the
//! certificate's common name.

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

fn tls_err(e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(e.to_string())
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
    /// # Errors
    /// [`TransportError::Tls`] when signing fails; [`TransportError::Config`] for an empty node
    /// name.
    pub fn issue(&self, node: &str) -> Result<MemberCredentials> {
        if node.is_empty() || node.contains(['/', '\\', '\n']) {
            return Err(TransportError::Config(format!(
                "invalid node name {node:?}"
            )));
        }
        let ca_key = KeyPair::from_pem(&self.ca_key_pem).map_err(tls_err)?;
        // Re-signing the same CA parameters with the same key yields an issuer with the
        // subject and key identifier of the CA on disk, which is all a signature chain needs.
        let ca_cert = ca_params(&self.name)?
            .self_signed(&ca_key)
            .map_err(tls_err)?;
        let mut params =
            CertificateParams::new(vec![MEMBER_SERVER_NAME.to_string()]).map_err(tls_err)?;
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
    /// # Errors
    /// I/O errors reading; [`TransportError::Tls`] when a file does not parse.
    pub fn load(dir: &Path, node: &str) -> Result<Self> {
        let cluster = std::fs::read_to_string(dir.join("cluster-name"))?
            .trim()
            .to_string();
        let ca = std::fs::read_to_string(dir.join("ca.crt"))?;
        let cert = std::fs::read_to_string(member_path(dir, node, "crt"))?;
        let key = std::fs::read_to_string(member_path(dir, node, "key"))?;
        Self::from_pem(&cluster, node, &ca, &cert, &key)
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
        let mut endpoint = quinn::Endpoint::server(server, addr)?;
        endpoint.set_default_client_config(client);
        Ok(endpoint)
    }
}

/// The crypto provider used everywhere (ring), passed explicitly so no process-wide default
/// has to be installed.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
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
}
