//! HTTPS for the API: [`HttpTls`] holds what a server serves (`tls_cert` + `tls_key`) and what
//! its outgoing calls trust (the system's roots plus `tls_ca`); the server's connection loop
//! ([`super::server`]) does the handshakes.
//!
//! One type serves an instance's API and the proxy's alike, and gives both their HTTP client,
//! so the proxy → instance and instance → instance calls verify the certificate of whoever
//! answers an `https://` URL. rustls with ring, the crypto the control plane already uses.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::DigitallySignedStruct;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How long pdserve's HTTP clients keep an idle connection.
pub const CLIENT_IDLE: std::time::Duration = std::time::Duration::from_secs(10);

/// Why the TLS settings could not be loaded: names the file and the config key.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file is missing, unreadable or holds nothing usable.
    #[error("{key} `{path}`: {message}")]
    File {
        key: &'static str,
        path: PathBuf,
        message: String,
    },
    /// One of certificate and key without the other.
    #[error("{given} is set but {missing} is not: HTTPS needs both")]
    Unpaired {
        given: &'static str,
        missing: &'static str,
    },
    /// rustls refused the certificate, the key or their pairing.
    #[error("TLS settings: {0}")]
    Rustls(#[from] rustls::Error),
}

/// HTTPS settings of one API server and its outgoing calls.
#[derive(Clone, Default)]
pub struct HttpTls {
    server: Option<Arc<rustls::ServerConfig>>,
    extra_roots: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for HttpTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpTls")
            .field("serves_https", &self.server.is_some())
            .field("extra_roots", &self.extra_roots.len())
            .finish()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl HttpTls {
    /// Loads PEM files: `cert` (a chain, leaf first) and `key` make the server speak HTTPS;
    /// `ca` adds roots its outgoing https calls trust beside the system's. `keys` name the
    /// config keys in errors (e.g. `["server.tls_cert", "server.tls_key", "server.tls_ca"]`).
    ///
    /// # Errors
    /// [`TlsError::File`] naming the key and path of a file that cannot be read or holds no
    /// certificate / key; [`TlsError::Rustls`] when the key does not match the certificate.
    pub fn load(
        cert: Option<&Path>,
        key: Option<&Path>,
        ca: Option<&Path>,
        keys: [&'static str; 3],
    ) -> Result<Self, TlsError> {
        let server = match (cert, key) {
            (Some(cert), Some(key)) => {
                let chain = certificates(cert, keys[0])?;
                let key = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::File {
                    key: keys[1],
                    path: key.to_path_buf(),
                    message: format!("no private key: {e}"),
                })?;
                let mut config = rustls::ServerConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()?
                    .with_no_client_auth()
                    .with_single_cert(chain, key)?;
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                Some(Arc::new(config))
            }
            (None, None) => None,
            (given, _) => {
                let (given, missing) = if given.is_some() {
                    (keys[0], keys[1])
                } else {
                    (keys[1], keys[0])
                };
                return Err(TlsError::Unpaired { given, missing });
            }
        };
        let extra_roots = match ca {
            Some(ca) => certificates(ca, keys[2])?,
            None => Vec::new(),
        };
        Ok(Self {
            server,
            extra_roots,
        })
    }

    /// A server speaking HTTPS with `config`; outgoing calls trust the system's roots.
    pub fn serving(config: Arc<rustls::ServerConfig>) -> Self {
        Self {
            server: Some(config),
            extra_roots: Vec::new(),
        }
    }

    /// Whether the server speaks HTTPS.
    pub fn serves_https(&self) -> bool {
        self.server.is_some()
    }

    /// `https` or `http`: the scheme of this server's URL, and of the peers it reaches by
    /// host and port alone (a cluster serves TLS on every instance or on none).
    pub fn scheme(&self) -> &'static str {
        if self.serves_https() {
            "https"
        } else {
            "http"
        }
    }

    /// The server side: `None` for plain HTTP.
    pub fn server_config(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.server.clone()
    }

    /// An HTTP client builder whose `https://` calls verify the answering server against the
    /// system's roots and `tls_ca` (no system proxy; plain `http://` works as before). On a
    /// machine without system roots and without `tls_ca`, https calls fail saying so.
    pub fn client(&self) -> reqwest::ClientBuilder {
        let provider = provider();
        // The system's roots are read from disk once per process, not per client.
        static SYSTEM_ONLY: std::sync::OnceLock<Arc<dyn ServerCertVerifier>> =
            std::sync::OnceLock::new();
        let verifier = if self.extra_roots.is_empty() {
            SYSTEM_ONLY.get_or_init(|| verifier(&[], &provider)).clone()
        } else {
            verifier(&self.extra_roots, &provider)
        };
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports rustls' default protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        reqwest::Client::builder()
            .no_proxy()
            // Idle connections are dropped well before a pdserve server closes them
            // (`header_read_timeout_s`, default 30 s, also bounds keep-alive idleness): a request
            // is then never written into a connection the server is closing.
            .pool_idle_timeout(CLIENT_IDLE)
            .tls_backend_preconfigured(config)
    }
}

/// The system's roots plus `extra`; a verifier that refuses everything, saying why, when
/// there are none.
fn verifier(
    extra: &[CertificateDer<'static>],
    provider: &Arc<CryptoProvider>,
) -> Arc<dyn ServerCertVerifier> {
    match rustls_platform_verifier::Verifier::new_with_extra_roots(
        extra.iter().cloned(),
        provider.clone(),
    ) {
        Ok(v) => Arc::new(v),
        Err(e) => Arc::new(NoRoots {
            why: e.to_string(),
            schemes: provider
                .signature_verification_algorithms
                .supported_schemes(),
        }),
    }
}

/// The HTTP client every part of pdserve uses (and tests should): https calls trust the
/// system's roots, no system proxy. reqwest's own TLS setup is never used: it would look for a
/// process-wide crypto provider pdserve does not install.
pub fn http_client() -> reqwest::ClientBuilder {
    HttpTls::default().client()
}

/// Trust when there is none to be had: every certificate is refused, naming why.
#[derive(Debug)]
struct NoRoots {
    why: String,
    schemes: Vec<rustls::SignatureScheme>,
}

impl NoRoots {
    fn refuse<T>(&self) -> Result<T, rustls::Error> {
        Err(rustls::Error::General(format!(
            "no trusted roots ({}): set tls_ca to the CA that signed the instances' certificates",
            self.why
        )))
    }
}

impl ServerCertVerifier for NoRoots {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls_pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.refuse()
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.refuse()
    }

    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.refuse()
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.schemes.clone()
    }
}

fn certificates(path: &Path, key: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file = |message: String| TlsError::File {
        key,
        path: path.to_path_buf(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file(format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(file("no certificate in the file".into()));
    }
    Ok(certs)
}
