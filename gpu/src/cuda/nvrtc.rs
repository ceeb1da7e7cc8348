//! NVRTC, the CUDA runtime compiler, loaded with `dlopen` and called through its C API, and the
//! on-disk cache of compiled PTX.
//!
//! NVRTC needs no GPU, so the same code compiles the kernels at startup on a GPU machine and in
//! CI on a machine without one (`gpu/tests/nvrtc.rs`, with the library from the PyPI wheel
//! `nvidia-cuda-nvrtc-cu12`). It is loaded by hand rather than through cudarc so that a missing
//! library is a typed error (cudarc panics) and so a test can name the exact file to load.
//!
//! The cache keeps one PTX file per (program, architecture, SHA-256 of source and options) in
//! `$PDSERVE_CUDA_KERNELS`, else `$PDSERVE_HOME/cuda-kernels/`. A warm cache needs no NVRTC at
//! all: the driver JIT-compiles PTX when the module is loaded. PTX compiled here can be carried
//! to a GPU machine in that directory.

use super::kernels::{nvrtc_options, KernelSource};
use crate::device::DeviceError;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable naming the NVRTC library file to load (e.g. the wheel's
/// `.../nvidia/cuda_nvrtc/lib/libnvrtc.so.12`).
pub const NVRTC_LIB_ENV: &str = "PDSERVE_NVRTC_LIB";

/// Environment variable overriding the PTX cache directory.
pub const KERNEL_CACHE_ENV: &str = "PDSERVE_CUDA_KERNELS";

/// Library names tried when [`NVRTC_LIB_ENV`] is unset (newest first).
pub const NVRTC_LIBRARIES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

type NvrtcProgram = *mut c_void;
type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type FnCreate = unsafe extern "C" fn(
    *mut NvrtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type FnCompile = unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int;
type FnSize = unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int;
type FnGet = unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int;
type FnDestroy = unsafe extern "C" fn(*mut NvrtcProgram) -> c_int;
type FnErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// A loaded NVRTC library.
#[derive(Debug)]
pub struct Nvrtc {
    library: String,
    version: (i32, i32),
    create: FnCreate,
    compile: FnCompile,
    log_size: FnSize,
    log: FnGet,
    ptx_size: FnSize,
    ptx: FnGet,
    destroy: FnDestroy,
    error_string: FnErrorString,
}

fn load_error(log: String) -> DeviceError {
    DeviceError::Compile {
        kernel: "(all)".into(),
        arch: "(any)".into(),
        log,
    }
}

impl Nvrtc {
    /// Loads NVRTC from `$PDSERVE_NVRTC_LIB`, else from the first of [`NVRTC_LIBRARIES`] the
    /// dynamic loader finds.
    ///
    /// # Errors
    /// [`DeviceError::Compile`] saying which libraries were tried.
    pub fn load() -> Result<Self, DeviceError> {
        match std::env::var(NVRTC_LIB_ENV) {
            Ok(path) if !path.is_empty() => Self::open(&path),
            _ => {
                let mut tried = Vec::new();
                for name in NVRTC_LIBRARIES {
                    match Self::open(name) {
                        Ok(n) => return Ok(n),
                        Err(e) => tried.push(e.to_string()),
                    }
                }
                Err(load_error(format!(
                    "NVRTC not found (set {NVRTC_LIB_ENV} to a libnvrtc.so file): {}",
                    tried.join("; ")
                )))
            }
        }
    }

    /// Loads NVRTC from `library` (a file path or a soname).
    ///
    /// # Errors
    /// [`DeviceError::Compile`] when it does not load or lacks an NVRTC symbol.
    pub fn open(library: &str) -> Result<Self, DeviceError> {
        let c = CString::new(library).map_err(|e| load_error(e.to_string()))?;
        // SAFETY: valid C string; the handle is never closed (NVRTC stays loaded).
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns null or a valid C string.
            let e = unsafe { libc::dlerror() };
            let why = if e.is_null() {
                "dlopen failed".to_string()
            } else {
                // SAFETY: non-null C string from libc.
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            return Err(load_error(format!("{library}: {why}")));
        }
        let sym = |name: &str| -> Result<*mut c_void, DeviceError> {
            let n = CString::new(name).map_err(|e| load_error(e.to_string()))?;
            // SAFETY: live handle, valid C string.
            let p = unsafe { libc::dlsym(h, n.as_ptr()) };
            if p.is_null() {
                Err(load_error(format!("{library} has no `{name}`: not NVRTC")))
            } else {
                Ok(p)
            }
        };
        // SAFETY: each symbol is the NVRTC function of that name, whose C signature (nvrtc.h)
        // the function-pointer type spells out.
        let n = unsafe {
            Nvrtc {
                library: library.to_string(),
                version: (0, 0),
                create: std::mem::transmute::<*mut c_void, FnCreate>(sym("nvrtcCreateProgram")?),
                compile: std::mem::transmute::<*mut c_void, FnCompile>(sym("nvrtcCompileProgram")?),
                log_size: std::mem::transmute::<*mut c_void, FnSize>(sym(
                    "nvrtcGetProgramLogSize",
                )?),
                log: std::mem::transmute::<*mut c_void, FnGet>(sym("nvrtcGetProgramLog")?),
                ptx_size: std::mem::transmute::<*mut c_void, FnSize>(sym("nvrtcGetPTXSize")?),
                ptx: std::mem::transmute::<*mut c_void, FnGet>(sym("nvrtcGetPTX")?),
                destroy: std::mem::transmute::<*mut c_void, FnDestroy>(sym("nvrtcDestroyProgram")?),
                error_string: std::mem::transmute::<*mut c_void, FnErrorString>(sym(
                    "nvrtcGetErrorString",
                )?),
            }
        };
        let version: FnVersion =
            // SAFETY: as above (`nvrtcVersion(int*, int*)`).
            unsafe { std::mem::transmute::<*mut c_void, FnVersion>(sym("nvrtcVersion")?) };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: valid out pointers.
        unsafe { version(&mut major, &mut minor) };
        Ok(Nvrtc {
            version: (major, minor),
            ..n
        })
    }

    /// The library that was loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Compiles `source` to PTX for `arch` (`sm_80`, `sm_90`, ...).
    ///
    /// # Errors
    /// [`DeviceError::Compile`] with the compiler's log.
    pub fn compile(&self, source: &KernelSource, arch: &str) -> Result<String, DeviceError> {
        let fail = |log: String| DeviceError::Compile {
            kernel: source.name.to_string(),
            arch: arch.to_string(),
            log,
        };
        let text = CString::new(source.full_source()).map_err(|e| fail(e.to_string()))?;
        let name = CString::new(format!("{}.cu", source.name)).map_err(|e| fail(e.to_string()))?;
        let opts: Vec<CString> = nvrtc_options(arch)
            .into_iter()
            .map(CString::new)
            .collect::<Result<_, _>>()
            .map_err(|e| fail(e.to_string()))?;
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: valid C strings; no headers are passed (count 0, null arrays).
        let rc = unsafe {
            (self.create)(
                &mut prog,
                text.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(fail(format!("nvrtcCreateProgram: {}", self.error_name(rc))));
        }
        let result = (|| {
            // SAFETY: a live program; the option pointers outlive the call.
            let rc = unsafe { (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
            if rc != 0 {
                let log = self.read(prog, self.log_size, self.log).unwrap_or_default();
                return Err(fail(format!("{}\n{log}", self.error_name(rc))));
            }
            self.read(prog, self.ptx_size, self.ptx)
                .map_err(|rc| fail(format!("nvrtcGetPTX: {}", self.error_name(rc))))
        })();
        // SAFETY: the program was created above and is destroyed once.
        unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn read(&self, prog: NvrtcProgram, size: FnSize, get: FnGet) -> Result<String, c_int> {
        let mut n = 0usize;
        // SAFETY: live program, valid out pointer.
        let rc = unsafe { size(prog, &mut n) };
        if rc != 0 {
            return Err(rc);
        }
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC said it will write.
        let rc = unsafe { get(prog, buf.as_mut_ptr() as *mut c_char) };
        if rc != 0 {
            return Err(rc);
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    fn error_name(&self, rc: c_int) -> String {
        // SAFETY: nvrtcGetErrorString returns a static C string for any code.
        let p = unsafe { (self.error_string)(rc) };
        if p.is_null() {
            format!("NVRTC error {rc}")
        } else {
            // SAFETY: non-null static C string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }
}

// SAFETY: NVRTC's API is thread-safe for distinct programs; the struct only holds function
// pointers into a library that is never unloaded.
unsafe impl Send for Nvrtc {}
// SAFETY: as above.
unsafe impl Sync for Nvrtc {}

/// PTX of every program for one architecture, from the cache or compiled on a miss.
#[derive(Debug)]
pub struct KernelCache {
    dir: PathBuf,
    compiler: OnceLock<Result<Nvrtc, DeviceError>>,
}

impl KernelCache {
    /// The cache in `$PDSERVE_CUDA_KERNELS`, else `$PDSERVE_HOME/cuda-kernels`.
    pub fn from_env() -> Self {
        let dir = std::env::var_os(KERNEL_CACHE_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::fetch::pdserve_home().join("cuda-kernels"));
        Self::new(dir)
    }

    /// A cache in `dir` (created on the first write).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            compiler: OnceLock::new(),
        }
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where `source` compiled for `arch` is kept.
    pub fn path_of(&self, source: &KernelSource, arch: &str) -> PathBuf {
        let key = source.cache_key(arch);
        self.dir
            .join(format!("{}-{arch}-{}.ptx", source.name, &key[..16]))
    }

    /// The PTX of `source` for `arch`: read from the cache, or compiled with NVRTC (loaded on
    /// first need) and written to the cache. Returns the PTX and whether it was a hit.
    ///
    /// # Errors
    /// [`DeviceError::Compile`] when NVRTC is missing or the source does not compile.
    pub fn ptx(&self, source: &KernelSource, arch: &str) -> Result<(String, bool), DeviceError> {
        let path = self.path_of(source, arch);
        if let Ok(ptx) = std::fs::read_to_string(&path) {
            if ptx.contains(".entry") {
                return Ok((ptx, true));
            }
        }
        let nvrtc = self
            .compiler
            .get_or_init(Nvrtc::load)
            .as_ref()
            .map_err(Clone::clone)?;
        let ptx = nvrtc.compile(source, arch)?;
        if let Err(e) = write_atomically(&path, ptx.as_bytes()) {
            tracing::warn!(path = %path.display(), error = %e, "cannot cache compiled kernel");
        }
        Ok((ptx, false))
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::kernels::SOURCES;

    #[test]
    fn a_missing_library_is_a_typed_error() {
        let e = Nvrtc::open("libpdserve-no-such-nvrtc.so").unwrap_err();
        assert_eq!(e.kind(), "cuda_compile");
        assert!(e.to_string().contains("libpdserve-no-such-nvrtc.so"), "{e}");
        let e = Nvrtc::open("libc.so.6").unwrap_err();
        assert!(e.to_string().contains("not NVRTC"), "{e}");
    }

    #[test]
    fn a_warm_cache_needs_no_compiler() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path());
        let src = &SOURCES[0];
        let fake = ".version 8.0\n.visible .entry rms_norm_f32(\n)\n";
        write_atomically(&cache.path_of(src, "sm_90"), fake.as_bytes()).unwrap();
        // The compiler is never loaded for a hit (it may not exist on this machine).
        let (ptx, hit) = cache.ptx(src, "sm_90").unwrap();
        assert!(hit);
        assert_eq!(ptx, fake);
        assert!(cache.compiler.get().is_none());
        // Another architecture is another file.
        assert_ne!(cache.path_of(src, "sm_80"), cache.path_of(src, "sm_90"));
    }
}
