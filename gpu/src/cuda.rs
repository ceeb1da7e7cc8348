//! The CUDA backend: the CPU backend's forward pass, paged KV layout and tensor-parallel
//! contract on NVIDIA GPUs, through cudarc with the driver loaded at run time (a binary built
//! with `--features cuda` still runs on a machine without a GPU).
//!
//! Always compiled (no GPU, no cudarc needed; unit-tested in every build):
//! - [`kernels`]: the CUDA C sources (RMSNorm, RoPE both styles, K/V writes into paged blocks,
//!   paged attention for mixed prefill/decode batches, SwiGLU, embedding, argmax);
//! - [`nvrtc`]: NVRTC loaded with `dlopen`, and the PTX cache keyed by source hash;
//! - [`launch`], [`layout`], [`plan`]: launch geometry, index arithmetic (KV offsets equal to
//!   the host layout's, cuBLAS argument mapping, block runs) and the per-step index arrays;
//! - [`handoff`]: greedy loops and the span-by-span KV copy of a P/D hand-off.
//!
//! Behind the cargo feature `cuda` (cudarc):
//! - `context`: one GPU's context, stream, kernels and cuBLAS handle;
//! - `model`: a rank's weights on the device and its forward pass;
//! - `kv`: the device KV cache (the host byte layout), its host mirror for the transfer
//!   engine, CUDA IPC;
//! - `executor`: ranks as device executors (a named thread and a stream each), the group;
//! - `verify`: the checks and measurements a GPU machine runs (`pdserve cuda verify`).
//!
//! See `docs/cuda.md` for what of this has run on a GPU.

pub mod fence;
pub mod handoff;
pub mod kernels;
pub mod launch;
pub mod layout;
pub mod nvrtc;
pub mod plan;

#[cfg(feature = "cuda")]
pub mod context;
#[cfg(feature = "cuda")]
pub mod executor;
#[cfg(feature = "cuda")]
pub mod kv;
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
pub mod verify;

#[cfg(feature = "cuda")]
pub use context::{GemmDtype, GpuContext};
#[cfg(feature = "cuda")]
pub use executor::{CudaOptions, CudaRankExecutor, CudaTpGroup};
#[cfg(feature = "cuda")]
pub use kv::{DeviceKvCache, MirrorMode};
