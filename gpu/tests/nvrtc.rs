//! Every CUDA kernel compiles with NVRTC for every architecture CI targets (sm_80, sm_90), and
//! every entry point the Rust side launches is in the PTX. Needs no GPU: NVRTC is a compiler.
//!
//! Run with the library of the PyPI wheel `nvidia-cuda-nvrtc-cu12` (`.ci/run` installs it):
//! `PDSERVE_NVRTC_LIB=.../nvidia/cuda_nvrtc/lib/libnvrtc.so.12 cargo test --release -p
//! pdserve-gpu --features cuda --test nvrtc`. Without the variable the tests fail: a kernel
//! that was never compiled must not pass.

use pdserve_gpu::cuda::kernels::{
    params, ptx_entries, ptx_param_types, KernelSource, ARCHS, SOURCES,
};
use pdserve_gpu::cuda::nvrtc::{KernelCache, Nvrtc, NVRTC_LIB_ENV};

fn nvrtc() -> Nvrtc {
    let lib = std::env::var(NVRTC_LIB_ENV).unwrap_or_else(|_| {
        panic!("set {NVRTC_LIB_ENV} to libnvrtc.so.12 of the nvidia-cuda-nvrtc-cu12 wheel")
    });
    Nvrtc::open(&lib).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn cuda_every_kernel_compiles_for_sm80_and_sm90() {
    let nvrtc = nvrtc();
    eprintln!("NVRTC {:?} from {}", nvrtc.version(), nvrtc.library());
    let mut compiled = 0;
    for src in SOURCES {
        for arch in ARCHS {
            let ptx = nvrtc
                .compile(src, arch)
                .unwrap_or_else(|e| panic!("{}.cu for {arch}: {e}", src.name));
            let cc = arch.trim_start_matches("sm_");
            assert!(
                ptx.contains(&format!(".target sm_{cc}")),
                "{}.cu for {arch}: PTX targets something else",
                src.name
            );
            let entries = ptx_entries(&ptx);
            for f in src.functions {
                assert!(
                    entries.iter().any(|e| e == f),
                    "{}.cu for {arch}: no entry `{f}` in {entries:?}",
                    src.name
                );
                // The argument list every launch is checked against is the kernel's own.
                let want: Vec<&str> = params(f).unwrap().iter().map(|p| p.ptx_type()).collect();
                assert_eq!(ptx_param_types(&ptx, f), want, "{f} for {arch}: parameters");
            }
            assert_eq!(
                entries.len(),
                src.functions.len(),
                "{}.cu defines kernels the Rust side does not list: {entries:?}",
                src.name
            );
            compiled += 1;
        }
    }
    assert_eq!(compiled, SOURCES.len() * ARCHS.len());
}

#[test]
fn cuda_a_kernel_that_does_not_compile_fails_with_the_compilers_log() {
    let broken = KernelSource {
        name: "broken",
        body: "extern \"C\" __global__ void k(float* x) { x[0] = undeclared_name; }\n",
        functions: &["k"],
    };
    let e = nvrtc().compile(&broken, "sm_90").unwrap_err();
    assert_eq!(e.kind(), "cuda_compile");
    let msg = e.to_string();
    assert!(msg.contains("broken.cu"), "{msg}");
    assert!(msg.contains("undeclared_name"), "{msg}");
}

#[test]
fn cuda_kernel_cache_compiles_once_then_hits() {
    // The cache loads NVRTC through the same variable.
    let _ = nvrtc();
    let dir = tempfile::tempdir().unwrap();
    let cache = KernelCache::new(dir.path());
    let src = &SOURCES[0];
    let (first, hit) = cache.ptx(src, "sm_80").unwrap();
    assert!(!hit);
    assert!(cache.path_of(src, "sm_80").exists());
    let (second, hit) = cache.ptx(src, "sm_80").unwrap();
    assert!(hit);
    assert_eq!(first, second);
}
