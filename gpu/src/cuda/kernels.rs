//! The CUDA C sources of every kernel, compiled at startup by NVRTC (see `nvrtc.rs`).
//!
//! Each [`KernelSource`] is one NVRTC program: the shared prelude `kernels/common.cuh`
//! followed by one `kernels/*.cu` file. `functions` lists the `extern "C"` entry points the
//! Rust side launches; the CI test (`gpu/tests/nvrtc.rs`) compiles every source for every
//! architecture in [`ARCHS`] and checks that each listed function is in the PTX, so a kernel
//! that does not compile, or a name that drifted, fails CI on a machine without a GPU.

use sha2::{Digest, Sha256};

/// The prelude every program starts with: 16-bit float types, warp reductions, the KV slot
/// offset formula.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// One NVRTC program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// Short name (also the file name without `.cu`).
    pub name: &'static str,
    /// The file's text (without the prelude).
    pub body: &'static str,
    /// The `extern "C"` kernels it defines.
    pub functions: &'static [&'static str],
}

impl KernelSource {
    /// Prelude + body, with a `#line` marker so compiler errors name the right file and line.
    pub fn full_source(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", self.name, self.body)
    }

    /// The cache key of this program compiled for `arch`: SHA-256 over the full source and
    /// the compiler options, in hex. (PTX of any NVRTC version loads on a newer driver, so the
    /// compiler's version is not part of the key: a cache filled here works on a GPU machine
    /// that has no NVRTC.)
    pub fn cache_key(&self, arch: &str) -> String {
        let mut h = Sha256::new();
        h.update(self.full_source().as_bytes());
        for o in nvrtc_options(arch) {
            h.update([0u8]);
            h.update(o.as_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Architectures CI compiles every kernel for (A100 and H100/H200). At run time the program is
/// compiled for the device's own compute capability.
pub const ARCHS: &[&str] = &["sm_80", "sm_90"];

/// Oldest compute capability the kernels support (bf16 conversion instructions).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// NVRTC options for `arch` (`sm_90` → PTX for `compute_90`; the driver JIT-compiles the PTX
/// for the exact device when the module is loaded).
pub fn nvrtc_options(arch: &str) -> Vec<String> {
    let cc = arch.strip_prefix("sm_").unwrap_or(arch);
    vec![
        format!("--gpu-architecture=compute_{cc}"),
        "--std=c++17".to_string(),
    ]
}

/// The `sm_XY` name of a compute capability.
pub fn arch_of(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

/// Every program.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "norm",
        body: include_str!("kernels/norm.cu"),
        functions: &["rms_norm_f32", "rms_norm_f16", "rms_norm_bf16"],
    },
    KernelSource {
        name: "rope",
        body: include_str!("kernels/rope.cu"),
        functions: &["rope_interleaved", "rope_half"],
    },
    KernelSource {
        name: "kv",
        body: include_str!("kernels/kv.cu"),
        functions: &["write_kv_f32", "write_kv_f16"],
    },
    KernelSource {
        name: "attention",
        body: include_str!("kernels/attention.cu"),
        functions: &[
            "paged_attention_f32_f32",
            "paged_attention_f32_f16",
            "paged_attention_f32_bf16",
            "paged_attention_f16_f32",
            "paged_attention_f16_f16",
            "paged_attention_f16_bf16",
            "attention_combine_f32",
            "attention_combine_f16",
            "attention_combine_bf16",
        ],
    },
    KernelSource {
        name: "elementwise",
        body: include_str!("kernels/elementwise.cu"),
        functions: &[
            "embedding_f32",
            "embedding_f16",
            "embedding_bf16",
            "silu_mul_f32",
            "silu_mul_f16",
            "silu_mul_bf16",
            "add_inplace",
            "bias_add",
            "scatter_rows",
        ],
    },
    KernelSource {
        name: "sampling",
        body: include_str!("kernels/sampling.cu"),
        functions: &["argmax_rows"],
    },
];

/// A kernel parameter, as the Rust side passes it and as the PTX declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A device pointer (PTX `.u64`).
    Ptr,
    /// `long long` (PTX `.u64`).
    I64,
    /// `int` (PTX `.u32`).
    I32,
    /// `unsigned int` (PTX `.u32`).
    U32,
    /// `float` (PTX `.f32`).
    F32,
}

impl Param {
    /// The PTX parameter type this compiles to.
    pub fn ptx_type(self) -> &'static str {
        match self {
            Param::Ptr | Param::I64 => ".u64",
            Param::I32 | Param::U32 => ".u32",
            Param::F32 => ".f32",
        }
    }
}

use Param::{Ptr as PP, F32 as PF, I32 as PI, I64 as PL, U32 as PU};

/// Parameter lists by kernel family (the name without its type suffix). The CI test checks
/// each against the PTX; every launch checks its arguments against it before launching, so
/// a drifted argument list is an error, not a kernel reading garbage.
const PARAMS: &[(&str, &[Param])] = &[
    ("rms_norm_", &[PP, PP, PP, PP, PF, PI, PP]),
    ("rope_", &[PP, PP, PI, PI, PI, PP, PP]),
    ("write_kv_", &[PP, PP, PI, PI, PI, PI, PI, PI, PP]),
    (
        "paged_attention_",
        &[PP, PI, PI, PI, PI, PP, PP, PP, PP, PI, PI, PP, PF, PP, PP],
    ),
    ("attention_combine_", &[PP, PI, PI, PI, PP, PP]),
    ("embedding_", &[PP, PP, PU, PU, PI, PP]),
    ("silu_mul_", &[PP, PL, PI, PP]),
    ("add_inplace", &[PP, PP, PL]),
    ("bias_add", &[PP, PP, PL, PI]),
    ("scatter_rows", &[PP, PP, PI, PI, PP]),
    ("argmax_rows", &[PP, PI, PP, PP, PP]),
];

/// The parameter list of `function`.
pub fn params(function: &str) -> Option<&'static [Param]> {
    SOURCES.iter().find(|s| s.functions.contains(&function))?;
    PARAMS
        .iter()
        .find(|(prefix, _)| function.starts_with(prefix))
        .map(|(_, p)| *p)
}

/// Checks the arguments a launch pushes against `function`'s parameters.
///
/// # Errors
/// [`crate::device::DeviceError::Runtime`] naming both lists when they differ.
pub fn check_args(function: &str, args: &[Param]) -> Result<(), crate::device::DeviceError> {
    match params(function) {
        Some(p) if p == args => Ok(()),
        p => Err(crate::device::DeviceError::Runtime {
            op: format!("launch {function}"),
            reason: format!("arguments {args:?} do not match the kernel's parameters {p:?}"),
        }),
    }
}

/// The PTX types of `entry`'s parameters, in order (empty when the entry is absent).
pub fn ptx_param_types(ptx: &str, entry: &str) -> Vec<String> {
    let Some(start) = ptx
        .find(&format!(".entry {entry}("))
        .map(|i| i + entry.len() + 8)
    else {
        return Vec::new();
    };
    let end = ptx[start..].find(')').map_or(ptx.len(), |e| start + e);
    ptx[start..end]
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some(".param")).then(|| it.next().unwrap_or("").to_string())
        })
        .collect()
}

/// The program that defines `function`, if any.
pub fn source_of(function: &str) -> Option<&'static KernelSource> {
    SOURCES.iter().find(|s| s.functions.contains(&function))
}

/// The `.entry` names a PTX text defines (what the CI test checks `functions` against).
pub fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix(".visible .entry ")
                .or_else(|| l.strip_prefix(".entry "))?;
            Some(rest.split('(').next().unwrap_or(rest).trim().to_string())
        })
        .collect()
}

/// The value of `#define NAME value` in a source, for constants both sides must agree on.
pub fn define_value(source: &str, name: &str) -> Option<i64> {
    source.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some("#define") && it.next() == Some(name))
            .then(|| it.next()?.parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_function_is_defined_once_in_its_own_source() {
        let mut seen = std::collections::HashSet::new();
        for s in SOURCES {
            for f in s.functions {
                assert!(seen.insert(*f), "{f} listed twice");
                let defined =
                    s.body.contains(&format!("void {f}(")) || s.body.contains(&format!("({f}, "));
                assert!(defined, "{f} is not defined in {}.cu", s.name);
                assert_eq!(source_of(f).map(|s| s.name), Some(s.name));
            }
        }
    }

    #[test]
    fn cache_keys_change_with_source_and_arch() {
        let s = &SOURCES[0];
        let k = s.cache_key("sm_90");
        assert_eq!(k.len(), 64);
        assert_eq!(k, s.cache_key("sm_90"));
        assert_ne!(k, s.cache_key("sm_80"));
        assert_ne!(k, SOURCES[1].cache_key("sm_90"));
    }

    #[test]
    fn every_function_has_a_parameter_list_and_launches_are_checked() {
        for s in SOURCES {
            for f in s.functions {
                assert!(params(f).is_some(), "{f} has no parameter list");
            }
        }
        assert!(check_args("bias_add", &[PP, PP, PL, PI]).is_ok());
        let e = check_args("bias_add", &[PP, PP, PI, PI]).unwrap_err();
        assert_eq!(e.kind(), "cuda_runtime");
        assert!(check_args("no_such_kernel", &[]).is_err());
    }

    #[test]
    fn ptx_param_types_are_parsed() {
        let ptx = ".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .f32 k_param_1\n)\n{";
        assert_eq!(ptx_param_types(ptx, "k"), vec![".u64", ".f32"]);
        assert!(ptx_param_types(ptx, "other").is_empty());
    }

    #[test]
    fn ptx_entries_are_parsed() {
        let ptx = "//\n.visible .entry rms_norm_f32(\n\t.param .u64 a\n)\n.entry other (\n";
        assert_eq!(ptx_entries(ptx), vec!["rms_norm_f32", "other"]);
    }

    #[test]
    fn options_target_ptx_of_the_arch() {
        assert_eq!(nvrtc_options("sm_90")[0], "--gpu-architecture=compute_90");
        assert_eq!(arch_of(8, 6), "sm_86");
    }
}
