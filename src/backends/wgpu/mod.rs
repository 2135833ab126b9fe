//! The WebGPU backend on wgpu: buffers are storage buffers, kernels the WGSL of
//! `shaders/` (device.rs builds and caches their pipelines). A step's dispatches are
//! recorded into one command encoder and submitted together when the executor syncs,
//! downloads or uploads; nothing is read back but outputs (and the few small parameter
//! inputs some ops take at run time: Slice starts, Reduce axes, Trilu's k, Dropout's
//! ratio, as the CUDA backend).
//!
//! Dtypes: f32 everywhere; f16 where the adapter offers SHADER_F16, otherwise an error.
//! f64 and bf16 have no WGSL type: errors. Integers: i32 arithmetic natively; i64 and
//! bool are moved (copies, shape ops, Where, Gather, Cast, comparisons' outputs) but not
//! computed with, since WGSL has no 64-bit integers (shape arithmetic is folded on the
//! host at plan time, so device integer work is rare).

mod attention;
mod conv;
pub mod device;
mod elementwise;
mod matmul;
mod optim;
mod reduce;
mod shape;

pub use device::{available, doctor_lines, set_subgroups};

use super::common::{bcast_strides, strides};
use super::Backend;
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{Node, Op, Optimizer};
use crate::tensor::{DType, Tensor};
use device::{Family, Kernel, Recorder};
use std::collections::HashMap;

/// The WebGPU backend: one instance per session (or data-parallel worker), on the
/// process-wide device (`device::gpu`).
pub struct Wgpu {
    rec: Recorder,
    /// Constant nodes' values, uploaded once per backend instance.
    consts: HashMap<String, wgpu::Buffer>,
    /// The mode of the next runs (`Backend::set_step`): 0 inference, t ≥ 1 training step t.
    step: u64,
    /// Scratch buffers, reused from node to node: the i-th scratch request of a node gets
    /// the i-th buffer (grown when too small), so a steady-state step creates none. Safe
    /// because the nodes' dispatches run in recording order and wgpu orders the accesses
    /// of one buffer from dispatch to dispatch; a buffer replaced while recorded work
    /// still uses it lives on until that work is done.
    pool: std::cell::RefCell<Vec<wgpu::Buffer>>,
    next: std::cell::Cell<usize>,
    /// The optimizer kernel's non-finite note (shaders/optimizer.wgsl `BAD`): u32::MAX
    /// for none.
    nonfinite: wgpu::Buffer,
}

/// One operand as the kernels see it.
#[derive(Clone, Copy)]
pub(crate) struct V<'a> {
    pub buf: &'a wgpu::Buffer,
    pub ty: &'a ValueType,
}

impl V<'_> {
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.ty.shape
    }
    pub fn numel(&self) -> usize {
        self.ty.numel()
    }
}

/// The error for an op this backend does not run in a dtype (SPEC §7: no silent fallback).
pub(crate) fn unsupported(node: &Node, dt: DType) -> crate::error::Error {
    let why = match dt {
        DType::F64 | DType::BF16 => " (WGSL has no such type)",
        DType::F16 => " (the adapter does not offer SHADER_F16)",
        DType::I64 | DType::U64 => " (WGSL has no 64-bit integers: the binary arithmetic, comparisons and bitwise maps run on word pairs, and casts)",
        _ => " (integer arithmetic: i32 runs the arithmetic and comparisons, Neg, Abs, Sign and Clip; u32 and the 8- and 16-bit integers the binary arithmetic and comparisons)",
    };
    crate::err!(
        Runtime,
        "{}: dtype {dt} is not supported by the wgpu backend{why}",
        node.describe()
    )
}

/// Whether float kernels run in `dt` on this device (for tests and `doctor`).
pub fn supports_float(dt: DType) -> bool {
    match dt {
        DType::F32 => true,
        DType::F16 => device::gpu().is_ok_and(|g| g.f16),
        _ => false,
    }
}

/// The WGSL lines that type a float kernel: storage `T`, compute `A`.
fn float_defs(w: &Wgpu, node: &Node, dt: DType) -> Result<String> {
    match dt {
        DType::F32 => Ok("alias T = f32;\nalias A = f32;\n".into()),
        DType::F16 if w.rec.gpu.f16 => Ok("enable f16;\nalias T = f16;\nalias A = f32;\n".into()),
        _ => Err(unsupported(node, dt)),
    }
}

/// Up to this many dims in a strided walk (shaders/common.wgsl `offset_at`).
const MAX_RANK: usize = 8;

/// A strided walk over `shape` for up to 3 operands (shaders/common.wgsl `offset_at`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Strided {
    pub shape: Vec<usize>,
    pub st: [Vec<i64>; 3],
    pub base: [i64; 3],
}

impl Strided {
    pub fn new(shape: &[usize], ops: &[&[i64]]) -> Strided {
        let mut s = Strided {
            shape: shape.to_vec(),
            ..Default::default()
        };
        for (k, o) in ops.iter().enumerate() {
            s.st[k] = o.to_vec();
        }
        s
    }
    /// Operands broadcast to `out`.
    pub fn broadcast(out: &[usize], ins: &[&[usize]]) -> Strided {
        let st: Vec<Vec<i64>> = ins.iter().map(|i| bcast_strides(i, out)).collect();
        let refs: Vec<&[i64]> = st.iter().map(|v| &v[..]).collect();
        Strided::new(out, &refs)
    }
    /// The 36 parameter words; dims of size 1 are dropped first, so only true rank counts.
    pub fn words(&self) -> Result<[u32; 36]> {
        let keep: Vec<usize> = (0..self.shape.len())
            .filter(|&d| self.shape[d] != 1)
            .collect();
        if keep.len() > MAX_RANK {
            crate::bail!(
                Runtime,
                "the wgpu backend walks at most {MAX_RANK} dims, got shape {:?}",
                self.shape
            );
        }
        let mut w = [0u32; 36];
        w[0] = keep.len() as u32;
        for (j, &d) in keep.iter().enumerate() {
            w[1 + j] = self.shape[d] as u32;
            for k in 0..3 {
                w[9 + k * 8 + j] = self.st[k].get(d).copied().unwrap_or(0) as i32 as u32;
            }
        }
        for k in 0..3 {
            w[33 + k] = self.base[k] as i32 as u32;
        }
        Ok(w)
    }
}

/// Parameter words: 16 scalars, then strided descriptors.
#[derive(Default)]
pub(crate) struct Params(pub Vec<u32>);

impl Params {
    pub fn new() -> Params {
        Params(vec![0; 16])
    }
    pub fn u(mut self, i: usize, v: usize) -> Params {
        self.set(i, v as u32);
        self
    }
    pub fn i(mut self, i: usize, v: i64) -> Params {
        self.set(i, v as i32 as u32);
        self
    }
    pub fn f(mut self, i: usize, v: f32) -> Params {
        self.set(i, v.to_bits());
        self
    }
    fn set(&mut self, i: usize, v: u32) {
        if self.0.len() <= i {
            self.0.resize(i + 1, 0);
        }
        self.0[i] = v;
    }
    /// A strided descriptor at word `at` (16 for the first, 52 for a second).
    pub fn strided(mut self, at: usize, s: &Strided) -> Result<Params> {
        let w = s.words()?;
        if self.0.len() < at + 36 {
            self.0.resize(at + 36, 0);
        }
        self.0[at..at + 36].copy_from_slice(&w);
        Ok(self)
    }
}

impl Wgpu {
    /// A backend on the shared device (`Err` where there is no adapter).
    pub fn new() -> Result<Wgpu> {
        let mut rec = Recorder::new(device::gpu()?);
        let nonfinite = rec.buffer(4);
        rec.write(&nonfinite, &u32::MAX.to_le_bytes())?;
        Ok(Wgpu {
            rec,
            consts: HashMap::new(),
            step: 0,
            pool: Default::default(),
            next: Default::default(),
            nonfinite,
        })
    }

    fn kernel(family: Family, entry: &str, defs: String) -> Kernel<'_> {
        Kernel {
            family,
            entry,
            defs,
        }
    }

    /// Records one dispatch of `entry` with buffers at the given bindings.
    fn run_kernel(
        &mut self,
        k: &Kernel,
        p: &Params,
        bufs: &[(u32, &wgpu::Buffer)],
        groups: [u32; 3],
    ) -> Result<()> {
        self.rec.dispatch(k, &p.0, bufs, groups)
    }

    /// Scratch storage of at least `bytes` bytes for the node being recorded (from the
    /// pool; see `pool`).
    fn scratch(&self, bytes: usize) -> wgpu::Buffer {
        let i = self.next.get();
        self.next.set(i + 1);
        let mut pool = self.pool.borrow_mut();
        let fresh = || self.rec.buffer(bytes);
        match pool.get(i) {
            Some(b) if b.size() >= bytes as u64 => return b.clone(),
            Some(_) => pool[i] = fresh(),
            None => pool.push(fresh()),
        }
        pool[i].clone()
    }

    /// Reads a small input back to the host (parameter inputs only).
    fn read(&mut self, v: &V) -> Result<Tensor> {
        let bytes = self.rec.read(v.buf, v.ty.bytes())?;
        Tensor::from_bytes(v.ty.dtype, &v.ty.shape, &bytes)
    }
}

impl Backend for Wgpu {
    type Buffer = wgpu::Buffer;
    fn name(&self) -> &'static str {
        "wgpu"
    }
    fn alloc(&mut self, bytes: usize) -> Result<wgpu::Buffer> {
        let max = self.rec.gpu.limits.max_buffer_size;
        if bytes as u64 > max {
            crate::bail!(
                Runtime,
                "wgpu: a buffer of {bytes} bytes is over the adapter's limit of {max}"
            );
        }
        Ok(self.rec.buffer(bytes))
    }
    fn upload(&mut self, src: &Tensor, dst: &mut wgpu::Buffer) -> Result<()> {
        self.rec.write(dst, src.bytes())
    }
    fn download(&mut self, src: &wgpu::Buffer, ty: &ValueType) -> Result<Tensor> {
        let bytes = self.rec.read(src, ty.bytes())?;
        Tensor::from_bytes(ty.dtype, &ty.shape, &bytes)
    }
    fn run(
        &mut self,
        node: &Node,
        ins: &[Option<(&wgpu::Buffer, &ValueType)>],
        outs: &mut [(&mut wgpu::Buffer, &ValueType)],
    ) -> Result<()> {
        let ins: Vec<Option<V>> = ins
            .iter()
            .map(|i| i.map(|(buf, ty)| V { buf, ty }))
            .collect();
        let outs: Vec<V> = outs.iter().map(|(b, ty)| V { buf: b, ty }).collect();
        let types = ins.iter().flatten().map(|v| v.ty);
        super::common::refuse_narrow(node, "wgpu", types.chain(outs.iter().map(|v| v.ty)))?;
        let want: Vec<bool> = node.outputs.iter().map(|o| !o.is_empty()).collect();
        self.next.set(0);
        self.run_node(node, &ins, &outs, &want)?;
        self.rec.gpu.check()
    }
    fn sync(&mut self) -> Result<()> {
        self.rec.wait()
    }
    fn update(
        &mut self,
        opt: &Optimizer,
        t: u64,
        param: &mut wgpu::Buffer,
        grad: &wgpu::Buffer,
        state: &mut [wgpu::Buffer],
        ty: &ValueType,
        slot: u32,
    ) -> Result<()> {
        self.next.set(0);
        optim::update(self, opt, t, param, grad, state, ty, slot)
    }
    fn accumulate(
        &mut self,
        acc: &mut wgpu::Buffer,
        grad: &wgpu::Buffer,
        ty: &ValueType,
        scale: f64,
        first: bool,
    ) -> Result<()> {
        self.next.set(0);
        optim::accumulate(self, acc, grad, ty, scale, first)
    }
    fn take_nonfinite(&mut self) -> Result<Option<u32>> {
        let v = self.rec.read(&self.nonfinite, 4)?;
        let slot = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
        if slot == u32::MAX {
            return Ok(None);
        }
        self.rec.write(&self.nonfinite, &u32::MAX.to_le_bytes())?;
        Ok(Some(slot))
    }
    fn set_step(&mut self, step: u64) {
        self.step = step;
    }
}

impl Wgpu {
    fn run_node(
        &mut self,
        node: &Node,
        ins: &[Option<V>],
        outs: &[V],
        want: &[bool],
    ) -> Result<()> {
        let x = |i: usize| super::common::required(node, ins, i);
        let opt = |i: usize| ins.get(i).copied().flatten();
        let y = outs[0];
        match &node.op {
            Op::Unary(u) => elementwise::unary(self, node, *u, &x(0)?, &y),
            Op::UnaryGrad(u) => elementwise::unary_grad(self, node, *u, &x(0)?, &x(1)?, &y),
            Op::Binary(b) => elementwise::binary(self, node, *b, &x(0)?, &x(1)?, &y),
            Op::Clip => elementwise::clip(self, node, &x(0)?, opt(1), opt(2), &y),
            Op::Dropout { ratio, seed } => {
                elementwise::dropout(self, node, &x(0)?, opt(1), opt(2), outs, *ratio, *seed)
            }
            Op::Random {
                normal, a, b, seed, ..
            } => elementwise::random(self, node, (*normal, *a, *b), *seed, &y),
            Op::Where => shape::where_(self, &x(0)?, &x(1)?, &x(2)?, &y),
            Op::Rotary { interleaved } | Op::RotaryGrad { interleaved } => {
                let t = matches!(node.op, Op::RotaryGrad { .. });
                let ins = [&x(0)?, &x(1)?, &x(2)?];
                elementwise::rotary(self, node, ins, (*interleaved, t), &y)
            }
            Op::Cast { .. } | Op::CastLike => shape::cast(self, node, &x(0)?, &y),
            Op::Range => elementwise::range(self, node, &x(0)?, &x(2)?, &y),
            Op::NonZero
            | Op::Unique { .. }
            | Op::NonMaxSuppression { .. }
            | Op::ResizeMatrix { .. } => super::common::plan_time_only(node),
            Op::Cumulative {
                prod,
                exclusive,
                reverse,
            } => elementwise::cumulative(
                self,
                node,
                &x(0)?,
                &x(1)?,
                *prod,
                [*exclusive, *reverse],
                &y,
            ),
            Op::ArgReduce {
                min,
                axis,
                select_last_index,
                ..
            } => reduce::arg_reduce(self, node, &x(0)?, *axis, *min, *select_last_index, &y),
            Op::TopK { axis, largest, .. } => {
                reduce::topk(self, node, &x(0)?, *axis, *largest, outs)
            }
            Op::Identity
            | Op::BitCast { .. }
            | Op::Reshape { .. }
            | Op::Squeeze { .. }
            | Op::Unsqueeze { .. }
            | Op::Flatten { .. } => {
                self.rec.copy(x(0)?.buf, y.buf, y.ty.bytes());
                Ok(())
            }
            Op::Constant { value } => self.constant(node, value.bytes(), &y),
            Op::Shape { start, end } => {
                let (s, e) = crate::graph::infer::shape_range(*start, *end, x(0)?.shape().len());
                let dims: Vec<i64> = x(0)?.shape()[s..e].iter().map(|&d| d as i64).collect();
                self.constant(node, bytemuck::cast_slice(&dims), &y)
            }
            Op::Trilu { upper } => shape::trilu(self, &x(0)?, opt(1), *upper, &y),
            Op::Transpose { perm } => shape::transpose(self, &x(0)?, perm.as_deref(), &y),
            Op::Concat { axis } => shape::concat(self, ins, *axis, &y),
            Op::Split { axis, .. } => shape::split(self, &x(0)?, *axis, outs),
            Op::Slice => shape::slice(self, &x(0)?, ins, &y),
            Op::SliceGrad => shape::slice_grad(self, &x(0)?, ins, &y),
            Op::Expand => shape::expand(self, &x(0)?, &y),
            Op::Gather { axis } => shape::gather(self, node, &x(0)?, &x(1)?, *axis, &y),
            Op::GatherGrad { axis } => shape::gather_grad(self, node, &x(0)?, &x(1)?, *axis, &y),
            Op::GatherElements { .. } | Op::GatherND { .. } => {
                shape::take(self, node, &x(0)?, &x(1)?, &y)
            }
            Op::GatherElementsGrad { .. } | Op::GatherNDGrad { .. } => {
                shape::take_grad(self, node, &x(0)?, &x(1)?, &y)
            }
            Op::Pad { .. } => shape::pad(self, node, &x(0)?, ins, &y),
            Op::PadGrad { .. } => shape::pad_grad(self, node, &x(0)?, ins, &y),
            Op::Conv { .. } => conv::conv(self, node, &x(0)?, &x(1)?, opt(2), &y),
            Op::FusedConv { activation, .. } => conv::fused_conv(
                self,
                node,
                [&x(0)?, &x(1)?],
                opt(2),
                opt(3),
                *activation,
                outs,
                want,
            ),
            Op::ConvGrad { .. } => {
                conv::conv_grad(self, node, [&x(0)?, &x(1)?, &x(2)?], outs, want)
            }
            Op::Im2Col { .. } => shape::im2col(self, node, &x(0)?, ins, &y),
            Op::Col2Im { .. } => shape::col2im(self, node, &x(0)?, ins, &y),
            Op::MaxPool { .. } => shape::max_pool(self, node, &x(0)?, &y),
            Op::MaxPoolGrad { .. } => shape::max_pool_grad(self, node, &x(0)?, &x(1)?, &y),
            Op::ScatterElements { reduction, .. } | Op::ScatterND { reduction } => {
                shape::scatter(self, node, [&x(0)?, &x(1)?, &x(2)?], *reduction, &y)
            }
            Op::MatMul => matmul::matmul(self, node, &x(0)?, &x(1)?, &y),
            Op::Gemm {
                alpha,
                beta,
                trans_a,
                trans_b,
            } => matmul::gemm(
                self,
                node,
                [&x(0)?, &x(1)?],
                opt(2),
                (*alpha, *beta),
                (*trans_a, *trans_b),
                &y,
            ),
            Op::FusedMatMul {
                activation,
                trans_b,
            } => matmul::fused(
                self,
                node,
                [&x(0)?, &x(1)?],
                opt(2),
                opt(3),
                *activation,
                *trans_b,
                outs,
                want,
            ),
            Op::GatedMatMul {
                activation,
                trans_b,
            } => matmul::gated(
                self,
                node,
                &x(0)?,
                [&x(1)?, &x(2)?],
                [opt(3), opt(4)],
                *activation,
                *trans_b,
                outs,
                want,
            ),
            Op::GatedMatMulGrad { activation, .. } => elementwise::glu(
                self,
                node,
                *activation,
                Some(&x(0)?),
                [&x(1)?, &x(2)?],
                &[&outs[0], &outs[1]],
            ),
            Op::FusedMatMulGrad {
                activation,
                trans_b,
                a_activation,
            } => matmul::fused_grad(
                self,
                node,
                [&x(0)?, &x(1)?, &x(2)?],
                opt(3),
                *activation,
                *trans_b,
                opt(4).map(|p| (p, *a_activation)),
                outs,
                want,
            ),
            Op::Softmax { axis } => reduce::softmax(self, node, &x(0)?, *axis, false, &y),
            Op::LogSoftmax { axis } => reduce::softmax(self, node, &x(0)?, *axis, true, &y),
            Op::SoftmaxGrad { axis, log } => {
                reduce::softmax_grad(self, node, &x(0)?, &x(1)?, *axis, *log, &y)
            }
            Op::LayerNormalization {
                axis,
                epsilon,
                rms,
                residual,
            } => {
                let (b, r) = crate::graph::op::norm_optional_inputs(*rms, *residual);
                reduce::layer_norm(
                    self,
                    node,
                    [&x(0)?, &x(1)?],
                    b.and_then(opt),
                    r.map(x).transpose()?,
                    (*axis, *epsilon, *rms),
                    outs,
                )
            }
            Op::LayerNormalizationGrad { axis, rms } => {
                let (m, i, r) = crate::graph::op::norm_grad_inputs(*rms);
                reduce::layer_norm_grad(
                    self,
                    node,
                    [&x(0)?, &x(1)?, &x(2)?],
                    m.map(x).transpose()?,
                    &x(i)?,
                    opt(r),
                    *axis,
                    outs,
                    want,
                )
            }
            Op::Reduce {
                kind,
                axes,
                noop_with_empty_axes,
                ..
            } => {
                let axes = match (axes, opt(1)) {
                    (Some(a), _) => a.clone(),
                    (None, Some(t)) => self.read(&t)?.to_i64_vec(),
                    (None, None) => vec![],
                };
                if axes.is_empty() && *noop_with_empty_axes {
                    self.rec.copy(x(0)?.buf, y.buf, y.ty.bytes());
                    return Ok(());
                }
                reduce::reduce(self, node, *kind, &x(0)?, &axes, &y)
            }
            Op::SoftmaxCrossEntropyLoss {
                reduction,
                ignore_index,
            } => reduce::sce(
                self,
                node,
                [&x(0)?, &x(1)?],
                opt(2),
                *reduction,
                *ignore_index,
                outs,
                want,
            ),
            Op::SoftmaxCrossEntropyLossGrad {
                reduction,
                ignore_index,
            } => reduce::sce_grad(
                self,
                node,
                [&x(0)?, &x(1)?, &x(2)?],
                opt(3),
                *reduction,
                *ignore_index,
                &y,
            ),
            Op::Attention {
                is_causal, scale, ..
            } => attention::attention(
                self,
                node,
                [Some(&x(0)?), opt(1).as_ref(), opt(2).as_ref()],
                opt(3),
                *is_causal,
                *scale,
                outs,
            ),
            Op::VarlenAttention { is_causal, scale } => attention::varlen(
                self,
                node,
                [&x(0)?, &x(1)?, &x(2)?],
                [&x(3)?, &x(4)?],
                *is_causal,
                *scale,
                outs,
            ),
            Op::AttentionGrad {
                is_causal, scale, ..
            } => attention::attention_grad(
                self,
                node,
                &x(0)?,
                [Some(&x(1)?), opt(2).as_ref(), opt(3).as_ref()],
                opt(6),
                [&x(4)?, &x(5)?],
                *is_causal,
                *scale,
                outs,
                want,
            ),
            Op::VarlenAttentionGrad { is_causal, scale } => attention::varlen_grad(
                self,
                node,
                [&x(0)?, &x(1)?, &x(2)?, &x(3)?],
                [&x(4)?, &x(5)?],
                [&x(6)?, &x(7)?],
                *is_causal,
                *scale,
                outs,
                want,
            ),
        }
    }

    /// A value known on the host (Constant, Shape): uploaded once, then copied per run.
    fn constant(&mut self, node: &Node, bytes: &[u8], y: &V) -> Result<()> {
        if !self.consts.contains_key(&node.name) {
            let b = self.rec.buffer(bytes.len());
            self.rec.write(&b, bytes)?;
            self.consts.insert(node.name.clone(), b);
        }
        if let Some(b) = self.consts.get(&node.name) {
            self.rec.copy(b, y.buf, y.ty.bytes());
        }
        Ok(())
    }
}
