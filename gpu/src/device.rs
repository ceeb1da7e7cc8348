//! Which device runs the model (`--device cpu|cuda[:N]`, config key `model.device`), and the
//! CUDA probe that decides, without touching cudarc, whether a CUDA device can be used.
//!
//! cudarc loads `libcuda` lazily and *panics* on its first driver call when the library is
//! absent. [`probe_cuda`] therefore opens the driver library itself (`dlopen`), calls `cuInit`
//! and `cuDeviceGetCount` through plain function pointers, and turns every failure into a typed
//! [`DeviceError`]. Only after it succeeded does the CUDA backend (feature `cuda`) touch
//! cudarc. The probe is compiled in every build, so a binary built without the `cuda` feature
//! can still say precisely why `--device cuda` cannot run.

use serde::{Deserialize, Serialize};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

/// Where the forward pass runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// Host CPU threads (the default).
    #[default]
    Cpu,
    /// A CUDA GPU, by ordinal; TP rank `r` uses GPU `ordinal + r`.
    Cuda {
        /// The first GPU's ordinal.
        ordinal: usize,
    },
}

impl Device {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda { .. })
    }
}

impl std::str::FromStr for Device {
    type Err = DeviceError;

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda { ordinal: 0 }),
            s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Ok(Device::Cuda { ordinal }),
                _ => Err(DeviceError::Parse(s.to_string())),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda { ordinal: 0 } => f.write_str("cuda"),
            Device::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// Why a device cannot be used, or a device operation failed.
///
/// Each variant has a stable [`DeviceError::kind`] string for metrics and logs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeviceError {
    /// The device string is not `cpu`, `cuda` or `cuda:N`.
    #[error("unknown device `{0}` (cpu, cuda, cuda:N)")]
    Parse(String),
    /// This binary was built without the `cuda` cargo feature.
    #[error(
        "this pdserve was built without CUDA support; rebuild with `cargo build --release \
         --features cuda` to use --device cuda"
    )]
    NotBuilt,
    /// No CUDA driver library could be loaded (no NVIDIA driver on this machine).
    #[error("no CUDA driver: {reason}")]
    NoDriver {
        /// What was tried and how it failed.
        reason: String,
    },
    /// The driver loaded but `cuInit` failed (driver/kernel-module mismatch, no device node).
    #[error("CUDA driver present but cuInit failed with CUresult {code}")]
    InitFailed {
        /// The `CUresult` code.
        code: i32,
    },
    /// The driver works but sees fewer GPUs than asked for.
    #[error("CUDA device {ordinal} requested but the driver sees {count} device(s)")]
    NoSuchDevice {
        /// The ordinal asked for (the last rank's GPU).
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// NVRTC (the runtime compiler) could not be loaded or failed to compile a kernel.
    #[error("CUDA kernel compilation failed ({kernel} for {arch}): {log}")]
    Compile {
        /// The kernel source's name.
        kernel: String,
        /// The target architecture (`sm_90`).
        arch: String,
        /// The compiler's log, or why the compiler could not run.
        log: String,
    },
    /// A CUDA driver, cuBLAS or memory operation failed at run time.
    #[error("CUDA {op} failed: {reason}")]
    Runtime {
        /// The operation (`alloc`, `launch rms_norm_f16`, `gemm`, `memcpy`...).
        op: String,
        /// The driver's or library's error.
        reason: String,
    },
    /// The model or the requested settings need something the CUDA backend does not do.
    #[error("not supported on CUDA: {0}")]
    Unsupported(String),
}

impl DeviceError {
    /// A short, stable name for this error's kind, for metrics labels and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Parse(_) => "bad_device",
            Self::NotBuilt => "cuda_not_built",
            Self::NoDriver { .. } => "no_cuda_driver",
            Self::InitFailed { .. } => "cuda_init_failed",
            Self::NoSuchDevice { .. } => "no_such_cuda_device",
            Self::Compile { .. } => "cuda_compile",
            Self::Runtime { .. } => "cuda_runtime",
            Self::Unsupported(_) => "cuda_unsupported",
        }
    }
}

/// Library names the CUDA driver is looked up under (the soname first: that is what the
/// driver package installs; the bare name exists only with development symlinks).
pub const CUDA_DRIVER_LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// What [`probe_cuda`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaProbe {
    /// The library that loaded.
    pub library: String,
    /// The driver's CUDA version (`cuDriverGetVersion`, e.g. 13000 for 13.0).
    pub driver_version: i32,
    /// Number of devices.
    pub device_count: usize,
}

/// Checks that a CUDA driver is installed and sees at least `min_devices` GPUs, without
/// touching cudarc (which panics when the driver is missing).
///
/// # Errors
/// [`DeviceError::NoDriver`] when no driver library loads, [`DeviceError::InitFailed`] when
/// `cuInit` fails, [`DeviceError::NoSuchDevice`] when there are fewer than `min_devices`.
pub fn probe_cuda(min_devices: usize) -> Result<CudaProbe, DeviceError> {
    probe_cuda_in(CUDA_DRIVER_LIBRARIES, min_devices)
}

/// [`probe_cuda`] over an explicit list of library names (tests use one that cannot exist).
///
/// # Errors
/// As [`probe_cuda`].
pub fn probe_cuda_in(libraries: &[&str], min_devices: usize) -> Result<CudaProbe, DeviceError> {
    let mut failures = Vec::new();
    for name in libraries {
        match DynLib::open(name) {
            Ok(lib) => return probe_library(&lib, name, min_devices),
            // dlerror's text names the library.
            Err(e) => failures.push(e),
        }
    }
    Err(DeviceError::NoDriver {
        reason: format!(
            "no NVIDIA driver library could be loaded ({})",
            failures
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        ),
    })
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuVersion = unsafe extern "C" fn(*mut c_int) -> c_int;

fn probe_library(lib: &DynLib, name: &str, min_devices: usize) -> Result<CudaProbe, DeviceError> {
    let missing = |sym: &str| DeviceError::NoDriver {
        reason: format!("{name} loaded but has no `{sym}`: not a CUDA driver library"),
    };
    let init = lib.symbol("cuInit").ok_or_else(|| missing("cuInit"))?;
    let count = lib
        .symbol("cuDeviceGetCount")
        .ok_or_else(|| missing("cuDeviceGetCount"))?;
    let version = lib
        .symbol("cuDriverGetVersion")
        .ok_or_else(|| missing("cuDriverGetVersion"))?;
    // SAFETY: the symbols come from the CUDA driver library and have these C signatures
    // (cuda.h); the out pointers are valid for the calls.
    let (rc, n, v) = unsafe {
        let init: CuInit = std::mem::transmute::<*mut c_void, CuInit>(init);
        let count: CuCount = std::mem::transmute::<*mut c_void, CuCount>(count);
        let version: CuVersion = std::mem::transmute::<*mut c_void, CuVersion>(version);
        let rc = init(0);
        let mut n: c_int = 0;
        let mut v: c_int = 0;
        if rc == 0 {
            let rc = count(&mut n);
            if rc != 0 {
                return Err(DeviceError::InitFailed { code: rc });
            }
            version(&mut v);
        }
        (rc, n, v)
    };
    if rc != 0 {
        return Err(DeviceError::InitFailed { code: rc });
    }
    let device_count = n.max(0) as usize;
    if device_count < min_devices {
        return Err(DeviceError::NoSuchDevice {
            ordinal: min_devices.saturating_sub(1),
            count: device_count,
        });
    }
    Ok(CudaProbe {
        library: name.to_string(),
        driver_version: v,
        device_count,
    })
}

/// A `dlopen`ed library, kept loaded for the life of the process once opened (the driver is
/// never unloaded: cudarc holds it too).
struct DynLib(*mut c_void);

/// Why `dlopen` refused a library name.
#[derive(Debug, thiserror::Error)]
enum DlopenError {
    /// The name holds a NUL byte, so it cannot be passed to `dlopen`.
    #[error(transparent)]
    Name(#[from] std::ffi::NulError),
    /// `dlopen` failed; `dlerror`'s text, which names the library.
    #[error("{0}")]
    Refused(String),
}

impl DynLib {
    fn open(name: &str) -> Result<Self, DlopenError> {
        let c = CString::new(name)?;
        // SAFETY: `c` is a valid C string; RTLD_NOW resolves symbols up front.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            return Err(DlopenError::Refused(dl_error()));
        }
        Ok(DynLib(handle))
    }

    fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: a live handle and a valid C string.
        let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a valid C string owned by libc.
    let e: *const c_char = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// Checks that `device` can be used by this binary: always for the CPU; for CUDA, that the
/// binary has the `cuda` feature and [`probe_cuda`] finds enough GPUs for `tp` ranks.
///
/// # Errors
/// [`DeviceError::NotBuilt`] or the probe's errors.
pub fn check_device(device: Device, tp: usize) -> Result<Option<CudaProbe>, DeviceError> {
    match device {
        Device::Cpu => Ok(None),
        Device::Cuda { ordinal } => {
            if !cfg!(feature = "cuda") {
                return Err(DeviceError::NotBuilt);
            }
            probe_cuda(ordinal + tp.max(1)).map(Some)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_strings_round_trip_and_bad_ones_are_typed_errors() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda { ordinal: 0 }),
            ("cuda:3", Device::Cuda { ordinal: 3 }),
        ] {
            assert_eq!(s.parse::<Device>().unwrap(), d);
            assert_eq!(d.to_string(), s);
        }
        for bad in ["gpu", "cuda:", "cuda:x", "CUDA", ""] {
            let e = bad.parse::<Device>().unwrap_err();
            assert_eq!(e.kind(), "bad_device", "{bad}");
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn a_missing_driver_library_is_a_typed_no_driver_error_not_a_panic() {
        let e = probe_cuda_in(&["libpdserve-no-such-cuda-driver.so.1"], 1).unwrap_err();
        assert_eq!(e.kind(), "no_cuda_driver");
        assert!(
            e.to_string()
                .contains("libpdserve-no-such-cuda-driver.so.1"),
            "{e}"
        );
    }

    #[test]
    fn a_library_without_cuda_symbols_is_refused() {
        // libc loads everywhere but is no CUDA driver.
        let e = probe_cuda_in(&["libc.so.6"], 1).unwrap_err();
        assert_eq!(e.kind(), "no_cuda_driver");
        assert!(e.to_string().contains("cuInit"), "{e}");
    }

    #[test]
    fn the_real_probe_agrees_with_the_presence_of_the_driver_library() {
        // On a machine without the NVIDIA driver (CI) this is NoDriver; with one, the probe
        // either succeeds or reports an init/device error, never a panic.
        let has_lib = CUDA_DRIVER_LIBRARIES
            .iter()
            .any(|n| DynLib::open(n).is_ok());
        match probe_cuda(1) {
            Ok(p) => assert!(has_lib && p.device_count >= 1),
            Err(e) if !has_lib => assert_eq!(e.kind(), "no_cuda_driver"),
            Err(e) => assert!(
                matches!(e.kind(), "cuda_init_failed" | "no_such_cuda_device"),
                "{e}"
            ),
        }
    }

    #[test]
    fn check_device_passes_cpu_and_explains_cuda() {
        assert_eq!(check_device(Device::Cpu, 4).unwrap(), None);
        let has_lib = CUDA_DRIVER_LIBRARIES
            .iter()
            .any(|n| DynLib::open(n).is_ok());
        if !has_lib {
            let e = check_device(Device::Cuda { ordinal: 0 }, 1).unwrap_err();
            let want = if cfg!(feature = "cuda") {
                "no_cuda_driver"
            } else {
                "cuda_not_built"
            };
            assert_eq!(e.kind(), want, "{e}");
        }
    }
}
