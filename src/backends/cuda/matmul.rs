//! Matrix products on cuBLASLt: MatMul (batched, broadcast), Gemm, FusedMatMul and its
//! backward. cudarc's safe cuBLASLt wrapper always computes f32 as TF32 and lacks most
//! epilogues, so this uses its `result`/`sys` layers: f32 is true FP32
//! (CUBLAS_COMPUTE_32F), f16/bf16 accumulate in f32, f64 in f64. Descriptors, layouts and
//! the heuristic's algorithm are made once per shape and cached.
//!
//! Tensors are row-major; cuBLASLt is column-major. A row-major `D[m, n] = A·B` is the
//! column-major `Dᵀ[n, m] = Bᵀ·Aᵀ`, so every call swaps the operands.

use super::device::{strides, Arg, Strided};
use super::elementwise::{act_epilogue, grad_kernel};
use super::{unsupported, Cuda, V};
use crate::backends::common::{act_code, wanted};
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Activation, Node};
use crate::tensor::{numel, DType};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

/// cuBLASLt workspace: what its heuristics may use for split-K and the like.
pub(super) const WORKSPACE: usize = 32 << 20;

/// One row-major product shape: `D[m, n] = op(A)[m, k] · op(B)[k, n]` for `batch`
/// matrices `sa`, `sb`, `sd` elements apart (`sa`/`sb` 0 for a shared operand). A is
/// stored `[m, k]`, or `[k, m]` when `ta`; B `[k, n]`, or `[n, k]` when `tb`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Shape {
    dt: DType,
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    batch: usize,
    sa: i64,
    sb: i64,
    sd: i64,
    epi: u32,
    /// Every row stored `ld` elements apart, its length rounded up to 16 bytes
    /// (`padded_product`); otherwise rows are packed.
    padded: bool,
}

impl Shape {
    /// (rows, columns) of A, B and D as stored, row-major.
    fn stored(&self) -> [(usize, usize); 3] {
        let (m, n, k) = (self.m, self.n, self.k);
        [
            if self.ta { (k, m) } else { (m, k) },
            if self.tb { (n, k) } else { (k, n) },
            (m, n),
        ]
    }

    /// The distance between rows of `cols` elements.
    fn ld(&self, cols: usize) -> usize {
        if self.padded {
            cols.next_multiple_of(16 / self.dt.size())
        } else {
            cols
        }
    }
}

/// The cuBLASLt objects of one `Shape`, made once.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3], // A (our B), B (our A), C = D
    algo: sys::cublasLtMatmulAlgo_t,
    /// The heuristic's other candidates, timed against `algo` at the first call that may
    /// run the product more than once (`tune`); empty once tuned.
    others: Vec<sys::cublasLtMatmulAlgo_t>,
}

/// How many of the heuristic's algorithms are timed per shape (`Tuning::cublaslt_tune`,
/// read once: 0 or 1 keeps the heuristic's first choice, as PyTorch does by default).
fn tune_candidates() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| crate::backends::tuning::tuning().cublaslt_tune.clamp(1, 16))
}

pub struct Blas {
    handle: sys::cublasLtHandle_t,
    /// f32 products on TF32 tensor cores (`--dtype tf32`) rather than true FP32.
    tf32: bool,
    workspace: CudaSlice<u8>,
    plans: RefCell<HashMap<Shape, Plan>>,
}

fn blas_err(what: &str, e: lt::CublasError) -> crate::error::Error {
    crate::err!(Runtime, "cuBLASLt {what} failed: {e:?}")
}

impl Blas {
    /// Whether f32 products may use TF32 tensor cores (`--dtype tf32`).
    pub fn tf32(&self) -> bool {
        self.tf32
    }

    pub fn new(stream: &std::sync::Arc<CudaStream>, tf32: bool) -> Result<Blas> {
        let handle = lt::create_handle().map_err(|e| blas_err("init", e))?;
        // Safety: scratch for cuBLASLt, which writes before it reads.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE) }
            .map_err(|e| crate::err!(Runtime, "CUDA allocation failed: {e:?}"))?;
        Ok(Blas {
            handle,
            tf32,
            workspace,
            plans: RefCell::new(HashMap::new()),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // Safety: the objects were made by this Blas and are no longer used.
        unsafe {
            for p in self.plans.borrow().values() {
                let _ = lt::destroy_matmul_desc(p.desc);
                for l in p.layouts {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

fn data_type(
    dt: DType,
) -> Option<(
    sys::cudaDataType,
    sys::cublasComputeType_t,
    sys::cudaDataType,
)> {
    use sys::cublasComputeType_t::*;
    use sys::cudaDataType::*;
    Some(match dt {
        DType::F32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        DType::F16 => (CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        DType::BF16 => (CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        DType::F64 => (CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F),
        _ => return None,
    })
}

unsafe fn set_desc<T>(
    d: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> std::result::Result<(), lt::CublasError> {
    lt::set_matmul_desc_attribute(
        d,
        a,
        v as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
}
unsafe fn set_layout<T>(
    l: sys::cublasLtMatrixLayout_t,
    a: sys::cublasLtMatrixLayoutAttribute_t,
    v: &T,
) -> std::result::Result<(), lt::CublasError> {
    lt::set_matrix_layout_attribute(
        l,
        a,
        v as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
}

impl Blas {
    /// Whether cuBLASLt has an algorithm for this shape and epilogue (made and cached).
    fn supports(&self, s: &Shape) -> bool {
        self.plan(s).is_ok()
    }

    fn plan(&self, s: &Shape) -> std::result::Result<(), lt::CublasError> {
        if self.plans.borrow().contains_key(s) {
            return Ok(());
        }
        use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatrixLayoutAttribute_t as L;
        let (ty, mut compute, scale) = data_type(s.dt).expect("checked by the caller");
        if self.tf32 && s.dt == DType::F32 {
            compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32;
        }
        let (m, n, k) = (s.m as u64, s.n as u64, s.k as u64);
        // Column-major operands: cuBLAS's A is our B (n × k), its B is our A (k × m).
        let ld = |cols: u64| s.ld(cols as usize) as i64;
        let (la, opa) = if s.tb {
            (lt::create_matrix_layout(ty, k, n, ld(k))?, CUBLAS_OP_T)
        } else {
            (lt::create_matrix_layout(ty, n, k, ld(n))?, CUBLAS_OP_N)
        };
        let (lb, opb) = if s.ta {
            (lt::create_matrix_layout(ty, m, k, ld(m))?, CUBLAS_OP_T)
        } else {
            (lt::create_matrix_layout(ty, k, m, ld(k))?, CUBLAS_OP_N)
        };
        let ld = lt::create_matrix_layout(ty, n, m, ld(n))?;
        let desc = lt::create_matmul_desc(compute, scale)?;
        // Safety: attributes of objects just made, with values of the documented types.
        unsafe {
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &opa)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &opb)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &s.epi)?;
            if s.epi & EPI_AUX != 0 {
                // Pre has D's layout: cuBLAS's rows are our n.
                let ld = n as i64;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld)?;
            }
            if s.batch > 1 {
                let count = s.batch as i32;
                for (l, st) in [(la, s.sb), (lb, s.sa), (ld, s.sd)] {
                    set_layout(l, L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)?;
                    set_layout(l, L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &st)?;
                }
            }
            let pref = lt::create_matmul_pref()?;
            let ws = WORKSPACE as u64;
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            )?;
            // The epilogue's bias pointer is set per call; a heuristic query needs one
            // set, so a placeholder goes in until then.
            let want = tune_candidates();
            let mut found = vec![std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>(); want];
            let mut count = 0i32;
            let h = sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                la,
                lb,
                ld,
                ld,
                pref,
                want as i32,
                found.as_mut_ptr(),
                &mut count,
            )
            .result();
            let _ = lt::destroy_matmul_pref(pref);
            h?;
            let mut algos = found[..count.max(0) as usize]
                .iter()
                .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo);
            let algo = algos.next().ok_or(lt::CublasError(
                sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
            ))?;
            self.plans.borrow_mut().insert(
                *s,
                Plan {
                    desc,
                    layouts: [la, lb, ld],
                    algo,
                    others: algos.collect(),
                },
            );
        }
        Ok(())
    }
}

/// cuBLASLt epilogue codes.
const EPI_DEFAULT: u32 = 1;
const EPI_RELU: u32 = 2;
const EPI_BIAS: u32 = 4;
const EPI_RELU_BIAS: u32 = 6;
const EPI_GELU: u32 = 32;
const EPI_GELU_BIAS: u32 = 36;
/// The AUX bit: the epilogue also writes its input (Pre) to the aux matrix.
const EPI_AUX: u32 = 128;
const EPI_GELU_AUX: u32 = 160;
const EPI_GELU_AUX_BIAS: u32 = 164;
/// The product times gelu_tanh'(aux): the backward of GELU_AUX(_BIAS).
const EPI_DGELU: u32 = 192;
/// DGELU, and the bias gradient (Σ over D's rows of what it writes) into the bias pointer.
const EPI_DGELU_BGRAD: u32 = 208;

/// Whether dBiasA comes from cuBLASLt's DGELU_BGRAD epilogue rather than DGELU and our
/// row sum after it (`Tuning::cublaslt_dgelu_bgrad`, off by default; read once).
fn dgelu_bgrad() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::backends::tuning::tuning().cublaslt_dgelu_bgrad)
}
/// Bias gradient of cuBLAS's A (resp. B) operand: its sum over the product's k dimension.
const EPI_BGRADA: u32 = 256;
const EPI_BGRADB: u32 = 512;

/// One (batched) product: `D = alpha·op(A)·op(B) + beta·C (+ bias, act)`; C is D when
/// `c` is None and beta != 0. `bias` is the bias (or, with a BGRAD epilogue, the bias
/// gradient written); `aux` the Pre matrix of an AUX epilogue.
#[allow(clippy::too_many_arguments)]
fn product(
    c: &Cuda,
    s: Shape,
    a: u64,
    b: u64,
    d: u64,
    cm: Option<u64>,
    alpha: f64,
    beta: f64,
    bias: u64,
) -> Result<()> {
    product_aux(c, s, a, b, d, cm, alpha, beta, bias, 0)
}

#[allow(clippy::too_many_arguments)]
fn product_aux(
    c: &Cuda,
    s: Shape,
    a: u64,
    b: u64,
    d: u64,
    cm: Option<u64>,
    alpha: f64,
    beta: f64,
    bias: u64,
    aux: u64,
) -> Result<()> {
    if s.m == 0 || s.n == 0 || s.batch == 0 {
        return Ok(());
    }
    if s.k == 0 {
        // An empty sum: D = beta·C, here only ever 0 (no caller passes C with k = 0).
        let ty = ValueType::new(s.dt, &[s.batch * s.m * s.n]);
        return c.memset0(&V {
            p: d,
            ty: &ty,
            buf: None,
        });
    }
    let k = Call {
        a,
        b,
        d,
        cm,
        alpha,
        beta,
        bias,
        aux,
    };
    if wants_padding(&s) {
        padded_product(c, s, k)
    } else {
        run(c, s, k)
    }
}

/// Whether `s` runs padded (`padded_product`): a big single product with a dimension or
/// an operand row whose length is not a multiple of 16 bytes, as GPT-2's vocabulary of
/// 50 257 makes them. cuBLASLt then has only kernels several times slower than its
/// tensor-core ones (on the H100, PyTorch's `[8192, 768] × [768, 50257]` in bf16 took 6.57
/// ms, and 0.89 ms with 50 264 columns; `Tuning::cublaslt_align_rows`). Not with an AUX
/// epilogue, whose matrix has D's rows.
fn wants_padding(s: &Shape) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let per = 16 / s.dt.size();
    !s.padded
        && s.batch == 1
        && s.dt != DType::F64
        && s.epi & EPI_AUX == 0
        && s.m * s.n * s.k >= 1 << 24
        && [s.m, s.n, s.k].iter().any(|&d| d % per != 0)
        && *ON.get_or_init(|| crate::backends::tuning::tuning().cublaslt_align_rows)
}

/// The product `s` on operands copied with their dimensions rounded up to 16 bytes (those
/// of 64 elements or more; with a bias epilogue, whose vector has D's columns, only their
/// rows' storage) and zeros in the added part, D computed so in scratch (from C when beta
/// is not 0) and its `[m, n]` copied out. Operands already so are read in place. The
/// copies cost a pass over each operand; the padding costs the product little.
fn padded_product(c: &Cuda, s: Shape, k: Call) -> Result<()> {
    let per = 16 / s.dt.size();
    let plain = matches!(s.epi, EPI_DEFAULT | EPI_RELU | EPI_GELU);
    let up = |d: usize| {
        if plain && d >= 64 {
            d.next_multiple_of(per)
        } else {
            d
        }
    };
    let p = Shape {
        m: up(s.m),
        n: up(s.n),
        k: up(s.k),
        padded: true,
        ..s
    };
    let esz = s.dt.size();
    let (have, want) = (s.stored(), p.stored());
    let stage = |ptr: u64, (rows, cols): (usize, usize), (prows, pcols): (usize, usize)| {
        let ld = p.ld(pcols);
        if (rows, cols) == (prows, ld) {
            return Ok(ptr);
        }
        let to = c.scratch(prows * ld * esz)?;
        c.zero_rows(to + (cols * esz) as u64, ld * esz, (ld - cols) * esz, rows)?;
        c.zero_rows(
            to + (rows * ld * esz) as u64,
            0,
            (prows - rows) * ld * esz,
            1,
        )?;
        c.copy_rows(ptr, cols * esz, to, ld * esz, cols * esz, rows)?;
        Ok(to)
    };
    let a = stage(k.a, have[0], want[0])?;
    let b = stage(k.b, have[1], want[1])?;
    let ((rows, cols), (prows, pcols)) = (have[2], want[2]);
    let ld = p.ld(pcols);
    if (rows, cols) == (prows, ld) {
        return run(c, p, Call { a, b, ..k });
    }
    let d = c.scratch(prows * ld * esz)?;
    if k.beta != 0.0 {
        // Only D's [m, n] is copied out: what the padding adds onto is never read.
        let from = k.cm.unwrap_or(k.d);
        c.copy_rows(from, cols * esz, d, ld * esz, cols * esz, rows)?;
    }
    let call = Call {
        a,
        b,
        d,
        cm: None,
        ..k
    };
    run(c, p, call)?;
    c.copy_rows(d, ld * esz, k.d, cols * esz, cols * esz, rows)
}

/// The planned product `s` (tuned first where it may be).
fn run(c: &Cuda, s: Shape, k: Call) -> Result<()> {
    let Call {
        a, b, d, cm, beta, ..
    } = k;
    let blas = &c.blas;
    blas.plan(&s).map_err(|e| blas_err("matmul setup", e))?;
    // Timing runs the product several times: only where that leaves the same result
    // (D is not also read as C, A or B) and the stream is not being recorded.
    // Small products (under 2³⁰ multiply-adds) keep the heuristic's choice: their times
    // are too close to the launch's to rank (mlp_small's step got slower when tuned).
    let big = s.batch * s.m * s.n * s.k >= 1 << 30;
    let rerunnable = big && (beta == 0.0 || cm.is_some_and(|x| x != d)) && a != d && b != d;
    if rerunnable && !blas.plans.borrow()[&s].others.is_empty() {
        // Safety: the stream is ours; only its capture status is read.
        let capturing =
            unsafe { cudarc::driver::result::stream::is_capturing(c.stream.cu_stream()) }
                .map(|st| {
                    st != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
                })
                .unwrap_or(true);
        if !capturing {
            blas.tune(c, &s, |algo| launch(c, &s, algo, &k))?;
        }
    }
    let algo = blas.plans.borrow()[&s].algo;
    launch(c, &s, &algo, &k)
}

impl Blas {
    /// Times the heuristic's candidates for `s` (each run once to warm up, then 3 times)
    /// and keeps the fastest; a candidate that fails is dropped.
    fn tune(
        &self,
        c: &Cuda,
        s: &Shape,
        run: impl Fn(&sys::cublasLtMatmulAlgo_t) -> Result<()>,
    ) -> Result<()> {
        let (first, others) = {
            let mut plans = self.plans.borrow_mut();
            let p = plans.get_mut(s).expect("planned");
            (p.algo, std::mem::take(&mut p.others))
        };
        let mut best = (f32::INFINITY, first);
        for algo in std::iter::once(first).chain(others) {
            let timed = || {
                c.time_runs(&|| run(&algo).map(|_| true))
                    .map(|t| t.unwrap_or(f32::INFINITY))
            };
            match timed() {
                Ok(ms) if ms < best.0 => best = (ms, algo),
                Ok(_) => {}
                // The first choice must work; another may not fit these buffers.
                Err(e) if algo == first => return Err(e),
                Err(_) => {}
            }
        }
        self.plans.borrow_mut().get_mut(s).expect("planned").algo = best.1;
        Ok(())
    }
}

/// The operands and scalars of one product (`product_aux`'s arguments).
#[derive(Clone, Copy)]
struct Call {
    a: u64,
    b: u64,
    d: u64,
    cm: Option<u64>,
    alpha: f64,
    beta: f64,
    bias: u64,
    aux: u64,
}

/// One cuBLASLt call of the planned shape `s` with algorithm `algo`.
fn launch(c: &Cuda, s: &Shape, algo: &sys::cublasLtMatmulAlgo_t, k: &Call) -> Result<()> {
    let Call {
        a,
        b,
        d,
        cm,
        alpha,
        beta,
        bias,
        aux,
    } = *k;
    let blas = &c.blas;
    let plans = blas.plans.borrow();
    let p = &plans[s];
    let stream = &c.stream;
    let (ws, _g) = blas.workspace.device_ptr(stream);
    // Safety: the pointers address live device buffers of the sizes the shape implies
    // (the plan sized them); alpha/beta live across the call.
    unsafe {
        if bias != 0 {
            set_desc(
                p.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &bias,
            )
            .map_err(|e| blas_err("bias", e))?;
        }
        if aux != 0 {
            set_desc(
                p.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                &aux,
            )
            .map_err(|e| blas_err("aux", e))?;
        }
        let (a32, b32) = (alpha as f32, beta as f32);
        let (pa, pb): (*const c_void, *const c_void) = if s.dt == DType::F64 {
            (&alpha as *const f64 as _, &beta as *const f64 as _)
        } else {
            (&a32 as *const f32 as _, &b32 as *const f32 as _)
        };
        let cptr = cm.unwrap_or(d);
        lt::matmul(
            blas.handle,
            p.desc,
            pa,
            pb,
            b as *const c_void,
            p.layouts[0],
            a as *const c_void,
            p.layouts[1],
            cptr as *const c_void,
            p.layouts[2],
            d as *mut c_void,
            p.layouts[2],
            algo,
            ws as *mut c_void,
            WORKSPACE,
            stream.cu_stream() as _,
        )
        .map_err(|e| blas_err("matmul", e))
    }
}

/// The matrices of a batched operand: dims `[batch.., r, c]` (a 1-D vector is one row or
/// one column, `as_row`).
fn split_batch(shape: &[usize], as_row: bool) -> (Vec<usize>, usize, usize) {
    match shape.len() {
        0 => (vec![], 1, 1),
        1 if as_row => (vec![], 1, shape[0]),
        1 => (vec![], shape[0], 1),
        r => (shape[..r - 2].to_vec(), shape[r - 2], shape[r - 1]),
    }
}

/// numpy broadcast of two batch shapes.
fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let x = if i + a.len() >= r {
                a[i + a.len() - r]
            } else {
                1
            };
            let y = if i + b.len() >= r {
                b[i + b.len() - r]
            } else {
                1
            };
            match (x, y) {
                _ if x == y => Some(x),
                (1, y) => Some(y),
                (x, 1) => Some(x),
                _ => None,
            }
        })
        .collect()
}

/// Offset (in elements) of each output batch entry's matrix in an operand with batch dims
/// `inp` broadcast to `out`, matrices of `mat` elements.
fn batch_offsets(out: &[usize], inp: &[usize], mat: usize) -> Vec<i64> {
    let st = super::device::bcast_strides(inp, out);
    let ost = strides(out);
    (0..numel(out))
        .map(|i| {
            (0..out.len())
                .map(|d| ((i as i64 / ost[d]) % out[d] as i64) * st[d])
                .sum::<i64>()
                * mat as i64
        })
        .collect()
}

/// A batched product with numpy-broadcast batch dims: `ab`/`bb` are the operands' batch
/// dims, `ob` the output's. Shared or fully batched operands go to cuBLASLt in one call;
/// other broadcasts loop over the output's matrices.
#[allow(clippy::too_many_arguments)]
fn batched(
    c: &Cuda,
    base: Shape,
    ab: &[usize],
    bb: &[usize],
    ob: &[usize],
    a: u64,
    b: u64,
    d: u64,
    cm: Option<u64>,
    beta: f64,
    bias: u64,
) -> Result<()> {
    let (na, nb_, nb) = (numel(ab), numel(bb), numel(ob));
    let (m, n, k) = (base.m, base.n, base.k);
    let esz = base.dt.size() as u64;
    let one = |s: Shape| product(c, s, a, b, d, cm, 1.0, beta, bias);
    if nb_ == 1 && na == nb && !base.ta {
        // A shared B under a contiguous batch of A is one tall product.
        return one(Shape { m: m * nb, ..base });
    }
    if (na == nb || na == 1) && (nb_ == nb || nb_ == 1) {
        let s = |x: usize, mat: usize| if x == 1 { 0 } else { mat as i64 };
        return one(Shape {
            batch: nb,
            sa: s(na, m * k),
            sb: s(nb_, k * n),
            sd: (m * n) as i64,
            ..base
        });
    }
    let (ao, bo) = (batch_offsets(ob, ab, m * k), batch_offsets(ob, bb, k * n));
    for i in 0..nb {
        let off_d = (i * m * n) as u64 * esz;
        let cm_i = cm.map(|p| p + off_d);
        product(
            c,
            base,
            a + ao[i] as u64 * esz,
            b + bo[i] as u64 * esz,
            d + off_d,
            cm_i,
            1.0,
            beta,
            bias,
        )?;
    }
    Ok(())
}

fn need_float(node: &Node, dt: DType) -> Result<()> {
    if data_type(dt).is_some() {
        Ok(())
    } else {
        Err(unsupported(node, dt))
    }
}

fn shape0(dt: DType, m: usize, n: usize, k: usize, ta: bool, tb: bool, epi: u32) -> Shape {
    Shape {
        dt,
        m,
        n,
        k,
        ta,
        tb,
        batch: 1,
        sa: 0,
        sb: 0,
        sd: 0,
        epi,
        padded: false,
    }
}

/// A's and B's batch dims and (m, k, n) of `A @ op(B)`.
fn dims(a: &V, b: &V, trans_b: bool) -> (Vec<usize>, Vec<usize>, usize, usize, usize) {
    let (ab, m, k) = split_batch(a.shape(), true);
    let (bb, r, cc) = split_batch(b.shape(), false);
    let n = if trans_b { r } else { cc };
    (ab, bb, m, k, n)
}

fn bcast_err(node: &Node, ab: &[usize], bb: &[usize]) -> crate::error::Error {
    crate::err!(
        Runtime,
        "{}: matmul batch dims {ab:?} and {bb:?} do not broadcast",
        node.describe()
    )
}

pub fn matmul(c: &Cuda, node: &Node, a: &V, b: &V, y: &V) -> Result<()> {
    let dt = a.dtype();
    need_float(node, dt)?;
    let (ab, bb, m, k, n) = dims(a, b, false);
    let ob = broadcast(&ab, &bb).ok_or_else(|| bcast_err(node, &ab, &bb))?;
    batched(
        c,
        shape0(dt, m, n, k, false, false, EPI_DEFAULT),
        &ab,
        &bb,
        &ob,
        a.p,
        b.p,
        y.p,
        None,
        0.0,
        0,
    )
}

/// ONNX Gemm: `alpha·op(A)·op(B) + beta·C`, C broadcast to `[M, N]` (copied into Y first,
/// then accumulated onto by cuBLASLt).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    c: &Cuda,
    node: &Node,
    a: &V,
    b: &V,
    cm: Option<V>,
    alpha: f32,
    beta: f32,
    ta: bool,
    tb: bool,
    y: &V,
) -> Result<()> {
    let dt = a.dtype();
    need_float(node, dt)?;
    let (m, n) = (y.shape()[0], y.shape()[1]);
    let k = if ta { a.shape()[0] } else { a.shape()[1] };
    let beta = match cm {
        Some(cv) if beta != 0.0 => {
            let src = super::device::bcast_strides(cv.shape(), y.shape());
            let st = Strided::new(y.shape(), &[&src, &strides(y.shape())], &[])?;
            let args = [
                Arg::Ptr(cv.p),
                Arg::Ptr(y.p),
                Arg::Strided(st),
                Arg::I64((m * n) as i64),
            ];
            c.launch_n(&format!("copy_{}", super::device::word(dt)), m * n, &args)?;
            beta as f64
        }
        _ => 0.0,
    };
    let s = shape0(dt, m, n, k, ta, tb, EPI_DEFAULT);
    product(c, s, a.p, b.p, y.p, None, alpha as f64, beta, 0)
}

/// Whether cuBLASLt's own GELU epilogue (the tanh approximation, computed with a fast
/// tanh) may stand for `gelu_tanh` in `dt`: for f16/bf16 (SPEC §8: 1e-2) and for f32 whose
/// products already run on TF32 (1e-3), not for true FP32, which is held to 1e-5.
fn lt_gelu_ok(blas: &Blas, dt: DType) -> bool {
    match dt {
        DType::F16 | DType::BF16 => true,
        DType::F32 => blas.tf32,
        _ => false,
    }
}

/// `act(A @ op(B) + bias) + residual`; with Pre asked for (training), Pre = A·op(B) + bias
/// and Y = act(Pre) + residual. cuBLASLt applies the bias and ReLU (and the tanh GELU
/// where `lt_gelu_ok`, with Pre from its GELU_AUX_BIAS); other activations and the
/// residual of an activated product go through our epilogue kernel.
#[allow(clippy::too_many_arguments)]
pub fn fused(
    c: &Cuda,
    node: &Node,
    a: &V,
    b: &V,
    bias: Option<V>,
    res: Option<V>,
    act: Activation,
    trans_b: bool,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let dt = a.dtype();
    need_float(node, dt)?;
    let (ab, bb, m, k, n) = dims(a, b, trans_b);
    let ob = broadcast(&ab, &bb).ok_or_else(|| bcast_err(node, &ab, &bb))?;
    let y = &outs[0];
    let pre = wanted(outs, want, 1);
    let bp = bias.map_or(0, |b| b.p);
    let has_bias = bp != 0;
    let pick = |plain: u32, with_bias: u32| if has_bias { with_bias } else { plain };
    // Inference in TF32 runs the product with the bias epilogue and the GELU as our
    // kernel: cuBLASLt's GELU epilogue made mlp_large's tf32 forward slower (0.509 vs
    // 0.494 ms on an H100, as PyTorch's addmm + GELU kernel).
    let lt_gelu = lt_gelu_ok(&c.blas, dt) && (pre.is_some() || dt != DType::F32);
    // What cuBLASLt applies itself, and what is left for our epilogue kernel.
    let (epi, left) = match (pre, act) {
        (Some(_), _) | (None, Activation::None) => (pick(EPI_DEFAULT, EPI_BIAS), act),
        (None, Activation::Relu) => (pick(EPI_RELU, EPI_RELU_BIAS), Activation::None),
        (None, Activation::GeluTanh) if lt_gelu => {
            (pick(EPI_GELU, EPI_GELU_BIAS), Activation::None)
        }
        (None, _) => (pick(EPI_DEFAULT, EPI_BIAS), act),
    };
    // One product (a shared B under a contiguous batch of A, or no batch): cuBLASLt's
    // GELU_AUX_BIAS writes Y = gelu_tanh(A·B + bias) and Pre = A·B + bias in one pass.
    let one_product = numel(&bb) == 1 && numel(&ab) == numel(&ob);
    let aux_epi = pick(EPI_GELU_AUX, EPI_GELU_AUX_BIAS);
    if let (Some(p), Activation::GeluTanh, None, true, true) = (pre, act, res, lt_gelu, one_product)
    {
        let s = shape0(dt, m * numel(&ob), n, k, false, trans_b, aux_epi);
        if c.blas.supports(&s) {
            return product_aux(c, s, a.p, b.p, y.p, None, 1.0, 0.0, bp, p.p);
        }
    }
    let dst = pre.unwrap_or(y);
    // A residual of the output's own shape rides in cuBLASLt's C when nothing follows.
    let res_in_c = pre.is_none()
        && left == Activation::None
        && epi != EPI_RELU
        && epi != EPI_RELU_BIAS
        && !matches!(epi, EPI_GELU | EPI_GELU_BIAS)
        && res.is_some_and(|r| r.shape() == y.shape());
    let (cm, beta) = match res {
        Some(r) if res_in_c => (Some(r.p), 1.0),
        _ => (None, 0.0),
    };
    let base = shape0(dt, m, n, k, false, trans_b, epi);
    batched(c, base, &ab, &bb, &ob, a.p, b.p, dst.p, cm, beta, bp)?;
    let res_left = if res_in_c { None } else { res };
    if pre.is_some() || left != Activation::None || res_left.is_some() {
        act_epilogue(c, left, dst.p, res_left.as_ref(), y)?;
    }
    Ok(())
}

/// GatedMatMul: G = A·Bg + bias_g and U = A·Bu + bias_u by cuBLASLt, into the outputs
/// that the graph reads (G otherwise into scratch, U into Y itself), then `Y = act(G)·U`
/// in one pass (in place when U is Y).
#[allow(clippy::too_many_arguments)]
pub fn gated(
    c: &Cuda,
    node: &Node,
    a: &V,
    [bg, bu]: [&V; 2],
    [bias_g, bias_u]: [Option<V>; 2],
    act: Activation,
    trans_b: bool,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let y = &outs[0];
    let g = match wanted(outs, want, 1) {
        Some(v) => *v,
        None => V {
            p: c.scratch(y.ty.bytes())?,
            ..*y
        },
    };
    let u = wanted(outs, want, 2).copied().unwrap_or(*y);
    for (w, bias, out) in [(bg, bias_g, g), (bu, bias_u, u)] {
        fused(
            c,
            node,
            a,
            w,
            bias,
            None,
            Activation::None,
            trans_b,
            &[out],
            &[true],
        )?;
    }
    super::elementwise::glu(c, act, None, [&g, &u], &[y])
}

/// `(dY, A, B, [Pre]) → (dA, dB, [dBias], [dBiasA])` with G = dY·act'(Pre): dA =
/// G·op(B)ᵀ, dB = Aᵀ·G (Gᵀ·A with trans_b), summed over the batch entries that share an
/// operand; dBias = Σ_rows G. With `pre_a` = (PreA, act_a), dA leaves multiplied by
/// act_a'(PreA): in cuBLASLt's DGELU epilogue for gelu_tanh in f16/bf16, else by our
/// kernel over dA in place; dBiasA = Σ_rows dA by a row sum after it (or by the
/// DGELU_BGRAD epilogue, see `dgelu_bgrad`).
#[allow(clippy::too_many_arguments)]
pub fn fused_grad(
    c: &Cuda,
    node: &Node,
    dy: &V,
    a: &V,
    b: &V,
    pre: Option<V>,
    act: Activation,
    trans_b: bool,
    pre_a: Option<(V, Activation)>,
    outs: &[V],
    want: &[bool],
) -> Result<()> {
    let dt = a.dtype();
    need_float(node, dt)?;
    let (ab, bb, m, k, n) = dims(a, b, trans_b);
    let ob = broadcast(&ab, &bb).ok_or_else(|| bcast_err(node, &ab, &bb))?;
    let (na, nbb, nb) = (numel(&ab), numel(&bb), numel(&ob));
    let w = |i: usize| wanted(outs, want, i);
    let g = match (act, pre) {
        (Activation::None, _) => dy.p,
        (_, None) => crate::bail!(
            Runtime,
            "{}: FusedMatMulGrad with activation {} needs the forward's Pre (input 3)",
            node.describe(),
            act.name()
        ),
        (_, Some(p)) => {
            let gv = V {
                p: c.scratch(dy.ty.bytes())?,
                ty: dy.ty,
                buf: None,
            };
            grad_kernel(c, dt, dy, &p, &gv, act_code(act), [0.0; 2])?;
            gv.p
        }
    };
    let esz = dt.size() as u64;
    let mut bias_done = false;
    if let Some(da) = w(0) {
        // dA[M, K] = G[M, N] · op(B)ᵀ.
        let s = shape0(dt, m, k, n, false, !trans_b, EPI_DEFAULT);
        // One tall product (B shared, A not broadcast) with gelu_tanh' in its epilogue.
        let dgelu = Shape {
            m: m * nb,
            epi: EPI_DGELU,
            ..s
        };
        let bgrad = Shape {
            epi: EPI_DGELU_BGRAD,
            ..dgelu
        };
        let dbias_a = w(3);
        let (mut in_epilogue, mut bias_a_done) = (false, false);
        match &pre_a {
            // Not under --dtype tf32: there cuBLASLt's DGELU made mlp_large's fc2 gradient
            // 0.30 ms slower on the H100 (0.50 → 0.80 ms), more than our pass costs.
            Some((pa, Activation::GeluTanh))
                if na == nb && nbb == 1 && matches!(dt, DType::BF16 | DType::F16) =>
            {
                if let Some(db) = dbias_a.filter(|_| dgelu_bgrad() && c.blas.supports(&bgrad)) {
                    product_aux(c, bgrad, g, b.p, da.p, None, 1.0, 0.0, db.p, pa.p)?;
                    (in_epilogue, bias_a_done) = (true, true);
                } else if c.blas.supports(&dgelu) {
                    product_aux(c, dgelu, g, b.p, da.p, None, 1.0, 0.0, 0, pa.p)?;
                    in_epilogue = true;
                }
            }
            _ => {}
        }
        if in_epilogue {
            // Written, derivative applied, by the epilogue.
        } else if na == nb {
            batched(c, s, &ob, &bb, &ob, g, b.p, da.p, None, 0.0, 0)?;
        } else {
            let bo = batch_offsets(&ob, &bb, k * n);
            let ao = batch_offsets(&ob, &ab, m * k);
            accumulate(c, s, nb, |i| {
                (
                    g + (i * m * n) as u64 * esz,
                    b.p + bo[i] as u64 * esz,
                    da.p + ao[i] as u64 * esz,
                )
            })?;
        }
        if let (Some((pa, act_a)), false) = (&pre_a, in_epilogue) {
            grad_kernel(c, dt, da, pa, da, act_code(*act_a), [0.0; 2])?;
        }
        if let (Some(db), false) = (dbias_a, bias_a_done) {
            super::reduce::sum_rows(c, da, da.ty.numel() / k.max(1), k, db)?;
        }
    } else if w(3).is_some() {
        crate::bail!(
            Runtime,
            "{}: dBiasA (output 3) needs dA (output 0)",
            node.describe()
        );
    }
    if let Some(db) = w(1) {
        // dB = Aᵀ·G ([K, N]) or, with trans_b, Gᵀ·A ([N, K]).
        let (l, r, ls, lm, ln) = if trans_b {
            (g, a.p, m * n, n, k)
        } else {
            (a.p, g, m * k, k, n)
        };
        let (lb, rb) = if trans_b {
            (&ob[..], &ab[..])
        } else {
            (&ab[..], &ob[..])
        };
        let s = shape0(dt, lm, ln, m, true, false, EPI_DEFAULT);
        if nbb == 1 && na == nb {
            // Σ_i A_iᵀ·G_i over a contiguous batch is one product over nb·M rows; the bias
            // gradient (Σ_rows G) comes with it from cuBLASLt's BGRAD epilogue, which sums
            // the operand that G is (cuBLAS's A without trans_b, its B with).
            let s = Shape { k: nb * m, ..s };
            let bg = Shape {
                epi: if trans_b { EPI_BGRADB } else { EPI_BGRADA },
                ..s
            };
            match w(2) {
                Some(dbias) if dt != DType::F64 && c.blas.supports(&bg) => {
                    product(c, bg, l, r, db.p, None, 1.0, 0.0, dbias.p)?;
                    bias_done = true;
                }
                _ => product(c, s, l, r, db.p, None, 1.0, 0.0, 0)?,
            }
        } else if nbb == nb {
            let st = |dims: &[usize], mat: usize| if numel(dims) == 1 { 0 } else { mat as i64 };
            let rs = if trans_b { m * k } else { m * n };
            product(
                c,
                Shape {
                    batch: nb,
                    sa: st(lb, ls),
                    sb: st(rb, rs),
                    sd: (k * n) as i64,
                    ..s
                },
                l,
                r,
                db.p,
                None,
                1.0,
                0.0,
                0,
            )?;
        } else {
            let lo = batch_offsets(&ob, lb, ls);
            let ro = batch_offsets(&ob, rb, if trans_b { m * k } else { m * n });
            let bo = batch_offsets(&ob, &bb, k * n);
            accumulate(c, s, nb, |i| {
                (
                    l + lo[i] as u64 * esz,
                    r + ro[i] as u64 * esz,
                    db.p + bo[i] as u64 * esz,
                )
            })?;
        }
    }
    if let (Some(dbias), false) = (w(2), bias_done) {
        let gv = V {
            p: g,
            ty: dy.ty,
            buf: None,
        };
        super::reduce::sum_rows(c, &gv, nb * m, n, dbias)?;
    }
    Ok(())
}

/// Products `i = 0..count` at the addresses `at(i)` = (A, B, D), each added onto what an
/// earlier one wrote at the same D (the gradient of a broadcast operand).
fn accumulate(
    c: &Cuda,
    s: Shape,
    count: usize,
    at: impl Fn(usize) -> (u64, u64, u64),
) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for i in 0..count {
        let (a, b, d) = at(i);
        let beta = if seen.insert(d) { 0.0 } else { 1.0 };
        product(c, s, a, b, d, None, 1.0, beta, 0)?;
    }
    Ok(())
}

/// `batch` row-major products `D[i] = op(A)[i]·op(B)[i]` (added onto D[i] when
/// `accumulate`), operand i at `base + i·stride` elements: the GEMMs of a convolution
/// without cuDNN (conv.rs).
#[allow(clippy::too_many_arguments)]
pub(super) fn strided_batch(
    c: &Cuda,
    dt: DType,
    (m, n, k): (usize, usize, usize),
    (ta, tb): (bool, bool),
    batch: usize,
    (a, sa): (u64, usize),
    (b, sb): (u64, usize),
    (d, sd): (u64, usize),
    accumulate: bool,
) -> Result<()> {
    let s = Shape {
        batch,
        sa: sa as i64,
        sb: sb as i64,
        sd: sd as i64,
        ..shape0(dt, m, n, k, ta, tb, EPI_DEFAULT)
    };
    product(
        c,
        s,
        a,
        b,
        d,
        None,
        1.0,
        if accumulate { 1.0 } else { 0.0 },
        0,
    )
}
