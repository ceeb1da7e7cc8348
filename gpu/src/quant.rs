//! Quantized CPU matmul kernels on GGUF's own block formats, with llama.cpp's numerics.
//!
//! Weights stay in the file's format (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K: no requantization). The
//! 32-element formats change layout at load, from GGUF's array of blocks to one structure of
//! arrays per group of four rows (the quants of each row, then the four rows' f16 scales
//! interleaved block by block, then likewise their f16 minimums), the same values; the
//! k-quants keep GGUF's 256-element super-blocks as they are. Activations are
//! quantized once per token row to the type llama.cpp pairs with the weight type (Q8_1 for
//! Q4_1, Q8_0 for Q4_0 and Q8_0, Q8_K for Q4_K and Q6_K), exactly as llama.cpp's AVX2
//! `quantize_row_q8_*` (Q8_K: `quantize_row_q8_K_ref`, what its x86 build runs) does.
//!
//! A dot product follows llama.cpp's AVX2 `ggml_vec_dot_*` operation for operation: per
//! 32-element block, eight integer lanes of four products each, converted to f32 and
//! accumulated with one fused multiply-add by `d_w · d_a` per lane; at the end the lanes are
//! summed in `hsum_float_8`'s order and (Q4_1) the block minimums' term `Σ m_w · s_a` is added.
//! The [`Isa::Scalar`] path does exactly those float operations lane by lane, so the AVX2 and
//! AVX-512 VNNI paths (which differ only in how they form the exact integer lane sums) equal
//! it bit for bit.
//!
//! Q4_K and Q6_K follow `ggml_vec_dot_q4_K_q8_K` / `ggml_vec_dot_q6_K_q8_K` the same way, per
//! 256-element super-block: eight i32 lanes of scale-weighted sub-block sums (Q6_K's `−32`
//! offset taken out with the activation `bsums`), one fused multiply-add by `d_w · d_a` per
//! lane, and (Q4_K) four lanes of the minimums' term `Σ mins · bsums`, fused-multiply-added by
//! `−d_a · dmin_w` and summed after the main lanes (`kquants` module docs). Their reduction
//! chunks (the `chunk` of [`matmul_chunked`]) count whole super-blocks. (llama.cpp itself
//! repacks Q4_K into 8-row interleaved blocks on AVX2 CPUs unless run with `--no-repack`; that
//! kernel's float order differs.)
//!
//! Decode's single-token matmuls (GEMV) run a group of four weight rows per kernel call,
//! sharing each activation block and converting the four rows' scales of a block with one
//! instruction, with software prefetch into L2 some 6 KiB ahead (a row of the default model
//! is 360–612 bytes, too short for the hardware prefetcher to learn, and a DRAM stream needs
//! more lines in flight than L1 tracks), and Q/K/V and gate/up run as one job on one
//! quantization of their shared input ([`matmul_many`], or [`matmul_concat`] writing the
//! matrices' results side by side per token).
//!
//! Prefill's GEMM (four tokens or more) runs tiles of four rows by four tokens, or on AVX-512
//! VNNI CPUs (Q4_0, Q4_1, Q8_0) `rows16`: one register holds one lane of sixteen rows, so a
//! `vpdpbusd` per lane serves sixteen rows, a (token, block)'s scale products are one vector
//! and the lanes are summed register by register — the same float operations per (row,
//! token), ~1.6–1.8× the four-row tile's speed (`PDSERVE_QUANT_ROWS16=off` turns it off).
//!
//! Matmuls run on one process-wide [`pool`] whose workers claim tiles of rows through a shared
//! cursor: a worker that is descheduled leaves its tiles to the others instead of holding
//! everybody at a barrier.

mod format;
mod isa;
mod kernels;
mod kquants;
mod matmul;
mod packed;
pub mod pool;
mod rows16;

pub use format::{dequantize_row, quantize_acts, ActType, QActs, QMatrix, QType, QK, QK_K};
pub use isa::{detect_isa, Isa};
pub use kernels::dot_chunks;
pub use matmul::{matmul, matmul_chunked, matmul_concat, matmul_many};
pub use packed::PackedQ8;
