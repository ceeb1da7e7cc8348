//! One GPU as a TP rank sees it: a CUDA context, one stream, the compiled kernels and a
//! cuBLAS handle bound to that stream. Everything a rank does on the device is ordered on that
//! one stream, so a later kernel sees what an earlier kernel or copy wrote.
//!
//! Built only after [`crate::device::probe_cuda`] succeeded: cudarc panics on a machine
//! without the driver, the probe returns an error instead.

use super::kernels::{self, arch_of, Param, MIN_COMPUTE_CAPABILITY, SOURCES};
use super::launch::Launch;
use super::layout::{GemmArgs, Op};
use super::nvrtc::KernelCache;
use crate::device::DeviceError;
use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Maps a driver/library error into [`DeviceError::Runtime`] for operation `op`.
pub(crate) fn rt<E: std::fmt::Debug>(op: &str) -> impl FnOnce(E) -> DeviceError + '_ {
    move |e| DeviceError::Runtime {
        op: op.to_string(),
        reason: format!("{e:?}"),
    }
}

/// Matmul operand element types on the device.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum GemmDtype {
    /// IEEE half precision (the default: the closest to the CPU backend's numbers).
    #[default]
    F16,
    /// bfloat16.
    Bf16,
    /// f32 (exact dequantized weights; twice the memory and bandwidth of f16).
    F32,
}

impl GemmDtype {
    /// The kernel-name suffix (`f16`, `bf16`, `f32`).
    pub fn suffix(self) -> &'static str {
        match self {
            GemmDtype::F16 => "f16",
            GemmDtype::Bf16 => "bf16",
            GemmDtype::F32 => "f32",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            GemmDtype::F32 => 4,
            _ => 2,
        }
    }

    fn cuda_type(self) -> blas_sys::cudaDataType {
        match self {
            GemmDtype::F16 => blas_sys::cudaDataType::CUDA_R_16F,
            GemmDtype::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
            GemmDtype::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        }
    }
}

impl std::str::FromStr for GemmDtype {
    type Err = DeviceError;
    /// `auto` (= f16), `f16`, `bf16`, `f32`.
    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s {
            "auto" | "f16" => Ok(GemmDtype::F16),
            "bf16" => Ok(GemmDtype::Bf16),
            "f32" => Ok(GemmDtype::F32),
            other => Err(DeviceError::Unsupported(format!(
                "dtype `{other}` (auto, f16, bf16, f32)"
            ))),
        }
    }
}

/// A device buffer of 16- or 32-bit matmul operands (16-bit values as raw bits).
#[derive(Debug)]
pub enum TypedBuffer {
    /// f32 values.
    F32(CudaSlice<f32>),
    /// f16 or bf16 bit patterns.
    Half(CudaSlice<u16>, GemmDtype),
}

impl TypedBuffer {
    /// The element type.
    pub fn dtype(&self) -> GemmDtype {
        match self {
            TypedBuffer::F32(_) => GemmDtype::F32,
            TypedBuffer::Half(_, d) => *d,
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            TypedBuffer::F32(s) => s.len(),
            TypedBuffer::Half(s, _) => s.len(),
        }
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn raw(&self, stream: &CudaStream) -> u64 {
        match self {
            TypedBuffer::F32(s) => s.device_ptr(stream).0,
            TypedBuffer::Half(s, _) => s.device_ptr(stream).0,
        }
    }
}

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum KArg<'a> {
    /// An f32 buffer.
    F32s(&'a CudaSlice<f32>),
    /// An i32 buffer.
    I32s(&'a CudaSlice<i32>),
    /// A u32 buffer.
    U32s(&'a CudaSlice<u32>),
    /// An i64 buffer.
    I64s(&'a CudaSlice<i64>),
    /// A matmul-operand buffer.
    Typed(&'a TypedBuffer),
    /// A raw device address (0 for a null pointer).
    Raw(u64),
    /// A `long long` (stored as its bits).
    I64(u64),
    /// An `int`.
    I32(i32),
    /// An `unsigned int`.
    U32(u32),
    /// A `float`.
    F32(f32),
}

impl KArg<'_> {
    /// The kind of parameter it fills.
    pub fn param(&self) -> Param {
        match self {
            KArg::F32s(_)
            | KArg::I32s(_)
            | KArg::U32s(_)
            | KArg::I64s(_)
            | KArg::Typed(_)
            | KArg::Raw(_) => Param::Ptr,
            KArg::I64(_) => Param::I64,
            KArg::I32(_) => Param::I32,
            KArg::U32(_) => Param::U32,
            KArg::F32(_) => Param::F32,
        }
    }
}

/// An `i64` kernel argument.
pub fn karg_i64(v: usize) -> KArg<'static> {
    KArg::I64(v as u64)
}

/// An `int` kernel argument.
pub fn karg_i32(v: usize) -> KArg<'static> {
    KArg::I32(v as i32)
}

/// One GPU's context, stream, kernels and cuBLAS handle.
pub struct GpuContext {
    ordinal: usize,
    arch: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    functions: HashMap<&'static str, CudaFunction>,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("ordinal", &self.ordinal)
            .field("arch", &self.arch)
            .finish()
    }
}

impl GpuContext {
    /// Opens GPU `ordinal`: probes the driver, creates the context and a stream, loads every
    /// kernel (from `cache`, compiling on a miss) and creates the cuBLAS handle.
    ///
    /// # Errors
    /// The probe's errors (no driver, no such device); [`DeviceError::Unsupported`] for a GPU
    /// older than sm_80; [`DeviceError::Compile`]; [`DeviceError::Runtime`].
    pub fn new(ordinal: usize, cache: &KernelCache) -> Result<Self, DeviceError> {
        crate::device::probe_cuda(ordinal + 1)?;
        let ctx = CudaContext::new(ordinal).map_err(rt("create context"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(rt("query compute capability"))?;
        if (major, minor) < MIN_COMPUTE_CAPABILITY {
            return Err(DeviceError::Unsupported(format!(
                "GPU {ordinal} is sm_{major}{minor}; the kernels need sm_{}{} or newer",
                MIN_COMPUTE_CAPABILITY.0, MIN_COMPUTE_CAPABILITY.1
            )));
        }
        let arch = arch_of(major, minor);
        let stream = ctx.new_stream().map_err(rt("create stream"))?;
        let mut functions = HashMap::new();
        for src in SOURCES {
            let (ptx, hit) = cache.ptx(src, &arch)?;
            tracing::debug!(kernel = src.name, %arch, cached = hit, "kernel PTX ready");
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(rt(&format!("load module {}", src.name)))?;
            for f in src.functions {
                let func = module
                    .load_function(f)
                    .map_err(rt(&format!("load function {f}")))?;
                functions.insert(*f, func);
            }
        }
        let blas = CudaBlas::new(stream.clone()).map_err(rt("create cuBLAS handle"))?;
        Ok(Self {
            ordinal,
            arch,
            ctx,
            stream,
            blas,
            functions,
        })
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The `sm_XY` the kernels were compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The rank's stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A loaded kernel.
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] for a name no source defines (a programming error).
    pub fn function(&self, name: &str) -> Result<&CudaFunction, DeviceError> {
        self.functions
            .get(name)
            .ok_or_else(|| DeviceError::Runtime {
                op: format!("launch {name}"),
                reason: "no such kernel".into(),
            })
    }

    /// Launches `name` with `launch` and `args` on the rank's stream, after checking the
    /// arguments' kinds against the kernel's parameter list ([`kernels::check_args`]).
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] for mismatched arguments or a failed launch.
    pub fn launch(&self, name: &str, launch: Launch, args: &[KArg<'_>]) -> Result<(), DeviceError> {
        let kinds: Vec<Param> = args.iter().map(KArg::param).collect();
        kernels::check_args(name, &kinds)?;
        let f = self.function(name)?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                KArg::F32s(s) => b.arg(*s),
                KArg::I32s(s) => b.arg(*s),
                KArg::U32s(s) => b.arg(*s),
                KArg::I64s(s) => b.arg(*s),
                KArg::Typed(TypedBuffer::F32(s)) => b.arg(s),
                KArg::Typed(TypedBuffer::Half(s, _)) => b.arg(s),
                KArg::Raw(p) | KArg::I64(p) => b.arg(p),
                KArg::I32(v) => b.arg(v),
                KArg::U32(v) => b.arg(v),
                KArg::F32(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: launch.grid,
            block_dim: launch.block,
            shared_mem_bytes: launch.shared_bytes,
        };
        // SAFETY: the argument kinds match the kernel's parameters (checked above); buffer
        // sizes follow the step plan (model.rs).
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(rt(&format!("launch {name}")))
    }

    /// `Y[rows, out] (f32) = X[rows, inp] · W[out, inp]ᵀ`, with X and W of the same type.
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] when cuBLAS fails; [`DeviceError::Unsupported`] for mixed
    /// operand types.
    pub fn linear(
        &self,
        w: &TypedBuffer,
        x: &TypedBuffer,
        y: &mut CudaSlice<f32>,
        args: GemmArgs,
    ) -> Result<(), DeviceError> {
        if w.dtype() != x.dtype() {
            return Err(DeviceError::Unsupported(format!(
                "matmul of {:?} weights by {:?} activations",
                w.dtype(),
                x.dtype()
            )));
        }
        let op = |o: Op| match o {
            Op::N => blas_sys::cublasOperation_t::CUBLAS_OP_N,
            Op::T => blas_sys::cublasOperation_t::CUBLAS_OP_T,
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let a = w.raw(&self.stream);
        let b = x.raw(&self.stream);
        let (c, _sync) = y.device_ptr_mut(&self.stream);
        let dt = w.dtype().cuda_type();
        // SAFETY: `args` comes from `linear_gemm`, whose leading dimensions and sizes match
        // the buffers (unit-tested); alpha/beta are host f32 as the compute type requires.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op(args.op_a),
                op(args.op_b),
                args.m as i32,
                args.n as i32,
                args.k as i32,
                &alpha as *const f32 as *const _,
                a as *const _,
                dt,
                args.lda as i32,
                b as *const _,
                dt,
                args.ldb as i32,
                &beta as *const f32 as *const _,
                c as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                args.ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(rt("cuBLAS gemm"))
    }

    /// Uploads `data` into a new device buffer.
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] on an allocation or copy failure.
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        data: &[T],
    ) -> Result<CudaSlice<T>, DeviceError> {
        self.stream.clone_htod(data).map_err(rt("upload"))
    }

    /// A zeroed device buffer of `n` elements.
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] on an allocation failure (out of device memory).
    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, DeviceError> {
        self.stream
            .alloc_zeros(n.max(1))
            .map_err(rt(&format!("alloc {n} elements")))
    }

    /// A zeroed buffer of matmul operands of type `dtype`.
    ///
    /// # Errors
    /// As [`GpuContext::zeros`].
    pub fn typed_zeros(&self, dtype: GemmDtype, n: usize) -> Result<TypedBuffer, DeviceError> {
        Ok(match dtype {
            GemmDtype::F32 => TypedBuffer::F32(self.zeros(n)?),
            d => TypedBuffer::Half(self.zeros(n)?, d),
        })
    }

    /// Uploads f32 values converted to `dtype` (round to nearest even, as the kernels' `cvt.rn`).
    ///
    /// # Errors
    /// As [`GpuContext::upload`].
    pub fn upload_as(&self, dtype: GemmDtype, values: &[f32]) -> Result<TypedBuffer, DeviceError> {
        Ok(match dtype {
            GemmDtype::F32 => TypedBuffer::F32(self.upload(values)?),
            GemmDtype::F16 => TypedBuffer::Half(
                self.upload(&to_half_bits(
                    values,
                    half::f16::from_f32,
                    half::f16::to_bits,
                ))?,
                dtype,
            ),
            GemmDtype::Bf16 => TypedBuffer::Half(
                self.upload(&to_half_bits(
                    values,
                    half::bf16::from_f32,
                    half::bf16::to_bits,
                ))?,
                dtype,
            ),
        })
    }

    /// Copies a device buffer back to the host (waits for the stream).
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] on a copy failure (including an earlier kernel's fault).
    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>, DeviceError> {
        self.stream.clone_dtoh(src).map_err(rt("download"))
    }

    /// Copies host values into an existing device buffer (stream-ordered).
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] on a copy failure.
    pub fn upload_into<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), DeviceError> {
        self.stream.memcpy_htod(src, dst).map_err(rt("upload"))
    }

    /// Waits until everything queued on the stream has run.
    ///
    /// # Errors
    /// [`DeviceError::Runtime`] with the first asynchronous failure.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        self.stream.synchronize().map_err(rt("synchronize"))
    }
}

/// f32 → 16-bit bit patterns through `half`'s round-to-nearest-even conversion.
pub fn to_half_bits<H: Copy>(
    values: &[f32],
    from: impl Fn(f32) -> H,
    bits: impl Fn(H) -> u16,
) -> Vec<u16> {
    values.iter().map(|&v| bits(from(v))).collect()
}
