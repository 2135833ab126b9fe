//! The CPU backend: the numerical reference for the others. Kernels are grouped by op
//! family; each takes host tensors already shaped by inference and fills its outputs.
//! f16/bf16 are stored as such and computed in f32; f64 is computed in f64.

mod attention;
mod conv;
mod data_shaped;
mod elementwise;
mod matmul;
mod nt;
mod optim;
mod reduce;
mod shape;
mod simd;
mod window;

use super::Backend;
use crate::error::Result;
use crate::graph::infer::ValueType;
use crate::graph::{HostEval, Node, Op};
use crate::tensor::{DType, Tensor};

pub use matmul::gemm_f32_gflops;

/// A raw pointer to an output handed to tasks that each write their own disjoint block
/// of it (a convolution's row blocks, a product's tiles).
#[derive(Clone, Copy)]
pub(super) struct Shared<F>(pub(super) *mut F);
// SAFETY: the tasks holding it write disjoint elements.
unsafe impl<F> Send for Shared<F> {}
unsafe impl<F> Sync for Shared<F> {}
impl<F> Shared<F> {
    /// Through a method, so that a closure captures the wrapper (Send), not the field.
    pub(super) fn ptr(&self) -> *mut F {
        self.0
    }
}

/// The CPU backend: buffers are host tensors, kernels run on rayon's thread pool.
#[derive(Default)]
pub struct Cpu {
    /// The training step (see `Backend::set_step`); 0 is inference.
    pub step: u64,
    /// `Backend::take_nonfinite`'s note.
    nonfinite: Option<u32>,
}

impl Backend for Cpu {
    type Buffer = Tensor;
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn alloc(&mut self, bytes: usize) -> Result<Tensor> {
        Tensor::try_alloc(bytes)
    }
    fn upload(&mut self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        dst.reset(src.dtype(), src.shape());
        dst.bytes_mut().copy_from_slice(src.bytes());
        Ok(())
    }
    fn download(&mut self, src: &Tensor, ty: &ValueType) -> Result<Tensor> {
        // A view's buffer may carry its input's shape (same bytes).
        let mut t = src.clone_exact();
        t.reset(ty.dtype, &ty.shape);
        Ok(t)
    }
    fn retype(&mut self, buf: &mut Tensor, ty: &ValueType) {
        buf.reset(ty.dtype, &ty.shape);
    }
    fn run(
        &mut self,
        node: &Node,
        ins: &[Option<(&Tensor, &ValueType)>],
        outs: &mut [(&mut Tensor, &ValueType)],
    ) -> Result<()> {
        // An input whose buffer holds another shape (two views of one buffer read by one
        // node; `retype` gave the buffer only one of them) is read through a copy.
        let copies: Vec<Option<Tensor>> = ins
            .iter()
            .map(|i| {
                let (t, ty) = (*i)?;
                (t.dtype() != ty.dtype || t.shape() != &ty.shape[..]).then(|| {
                    let mut c = t.clone_exact();
                    c.reset(ty.dtype, &ty.shape);
                    c
                })
            })
            .collect();
        let ins: Vec<Option<&Tensor>> = ins
            .iter()
            .zip(&copies)
            .map(|(i, c)| c.as_ref().or(i.map(|(t, _)| t)))
            .collect();
        let mut owned: Vec<Tensor> = outs
            .iter_mut()
            .map(|(b, ty)| {
                let mut t = std::mem::replace(*b, Tensor::zeros(DType::Bool, &[0]));
                t.reset(ty.dtype, &ty.shape);
                t
            })
            .collect();
        let r = run_node(node, &ins, &mut owned, self.step);
        for ((b, _), t) in outs.iter_mut().zip(owned) {
            **b = t;
        }
        r
    }
    fn sync(&mut self) -> Result<()> {
        Ok(())
    }
    fn update(
        &mut self,
        opt: &crate::graph::Optimizer,
        t: u64,
        param: &mut Tensor,
        grad: &Tensor,
        state: &mut [Tensor],
        _ty: &ValueType,
        slot: u32,
    ) -> Result<()> {
        if !optim::update(opt, t, param, grad, state)? {
            self.nonfinite = Some(self.nonfinite.map_or(slot, |s| s.min(slot)));
        }
        Ok(())
    }
    fn accumulate(
        &mut self,
        acc: &mut Tensor,
        grad: &Tensor,
        _ty: &ValueType,
        scale: f64,
        first: bool,
    ) -> Result<()> {
        optim::accumulate(acc, grad, scale, first)
    }
    fn take_nonfinite(&mut self) -> Result<Option<u32>> {
        Ok(self.nonfinite.take())
    }
    fn set_step(&mut self, step: u64) {
        self.step = step;
    }
}

/// Runs one node on host tensors. `outs` are already typed and shaped.
pub fn run_node(
    node: &Node,
    ins: &[Option<&Tensor>],
    outs: &mut [Tensor],
    step: u64,
) -> Result<()> {
    let x = |i: usize| super::common::required(node, ins, i);
    let opt = |i: usize| ins.get(i).copied().flatten();
    // Which outputs the graph reads (an optional output named "" is not computed).
    let want: Vec<bool> = node.outputs.iter().map(|o| !o.is_empty()).collect();
    match &node.op {
        Op::Unary(u) => elementwise::unary(*u, x(0)?, &mut outs[0]),
        Op::Binary(b) => elementwise::binary(*b, x(0)?, x(1)?, &mut outs[0]),
        Op::Clip => elementwise::clip(
            x(0)?,
            ins.get(1).copied().flatten(),
            ins.get(2).copied().flatten(),
            &mut outs[0],
        ),
        Op::Where => elementwise::where_(x(0)?, x(1)?, x(2)?, &mut outs[0]),
        Op::Rotary { interleaved } | Op::RotaryGrad { interleaved } => {
            let t = matches!(node.op, Op::RotaryGrad { .. });
            elementwise::rotary([x(0)?, x(1)?, x(2)?], *interleaved, t, &mut outs[0])
        }
        Op::Range => elementwise::range(x(0)?, x(2)?, &mut outs[0]),
        Op::NonZero
        | Op::Unique { .. }
        | Op::NonMaxSuppression { .. }
        | Op::ResizeMatrix { .. } => {
            let fail = |e: String| crate::error::Error::Graph(format!("{}: {e}", node.describe()));
            let got = match node.op {
                Op::ResizeMatrix { .. } => {
                    let x = x(0)?;
                    crate::graph::resize::eval(
                        &node.op,
                        x.dtype(),
                        x.shape(),
                        opt(1),
                        opt(2),
                        opt(3),
                    )
                }
                _ => data_shaped::eval(&node.op, ins),
            }
            .map_err(fail)?;
            for (o, t) in outs.iter_mut().zip(got) {
                if o.shape() != t.shape() {
                    return Err(fail(format!(
                        "its output has shape {}, but the plan was made for {}: its inputs changed after planning",
                        crate::tensor::fmt_shape(t.shape()),
                        crate::tensor::fmt_shape(o.shape())
                    )));
                }
                o.bytes_mut().copy_from_slice(t.bytes());
            }
            Ok(())
        }
        Op::Cumulative {
            prod,
            exclusive,
            reverse,
        } => elementwise::cumulative(
            node,
            x(0)?,
            x(1)?,
            *prod,
            [*exclusive, *reverse],
            &mut outs[0],
        ),
        Op::ArgReduce {
            min,
            axis,
            select_last_index,
            ..
        } => reduce::arg_reduce(node, x(0)?, *axis, *min, *select_last_index, &mut outs[0]),
        Op::TopK { axis, largest, .. } => reduce::topk(node, x(0)?, *axis, *largest, outs),
        Op::Cast { .. } | Op::CastLike => {
            crate::tensor::cast_into(x(0)?, &mut outs[0]);
            Ok(())
        }
        Op::Identity | Op::BitCast { .. } => {
            outs[0].bytes_mut().copy_from_slice(x(0)?.bytes());
            Ok(())
        }
        Op::Dropout { ratio, seed } => elementwise::dropout(node, ins, outs, *ratio, *seed, step),
        Op::Random {
            normal, a, b, seed, ..
        } => elementwise::random(node, (*normal, *a, *b), *seed, step, &mut outs[0]),
        Op::Trilu { upper } => {
            elementwise::trilu(x(0)?, ins.get(1).copied().flatten(), *upper, &mut outs[0])
        }
        Op::MatMul => matmul::matmul(x(0)?, x(1)?, &mut outs[0]),
        Op::Gemm {
            alpha,
            beta,
            trans_a,
            trans_b,
        } => matmul::gemm(
            x(0)?,
            x(1)?,
            ins.get(2).copied().flatten(),
            *alpha,
            *beta,
            *trans_a,
            *trans_b,
            &mut outs[0],
        ),
        Op::FusedMatMul {
            activation,
            trans_b,
        } => matmul::fused_matmul(
            x(0)?,
            x(1)?,
            ins.get(2).copied().flatten(),
            ins.get(3).copied().flatten(),
            *activation,
            *trans_b,
            outs,
        ),
        Op::GatedMatMul {
            activation,
            trans_b,
        } => matmul::gated_matmul(
            x(0)?,
            [x(1)?, x(2)?],
            [opt(3), opt(4)],
            *activation,
            *trans_b,
            &want,
            outs,
        ),
        Op::GatedMatMulGrad { activation, .. } => {
            matmul::gated_grad(*activation, x(0)?, x(1)?, x(2)?, outs)
        }
        Op::Softmax { axis } => reduce::softmax(x(0)?, *axis, false, &mut outs[0]),
        Op::LogSoftmax { axis } => reduce::softmax(x(0)?, *axis, true, &mut outs[0]),
        Op::LayerNormalization {
            axis,
            epsilon,
            rms,
            residual,
        } => {
            let (b, r) = crate::graph::op::norm_optional_inputs(*rms, *residual);
            reduce::layer_norm(
                x(0)?,
                x(1)?,
                b.and_then(opt),
                r.map(x).transpose()?,
                *axis,
                *epsilon,
                *rms,
                outs,
            )
        }
        Op::Reduce {
            kind,
            axes,
            noop_with_empty_axes,
            ..
        } => {
            let axes = match axes {
                Some(a) => a.clone(),
                None => ins
                    .get(1)
                    .copied()
                    .flatten()
                    .map(|t| t.to_i64_vec())
                    .unwrap_or_default(),
            };
            let r = x(0)?.shape().len();
            if axes.is_empty() && *noop_with_empty_axes {
                outs[0].bytes_mut().copy_from_slice(x(0)?.bytes());
                return Ok(());
            }
            let axes: Vec<usize> = if axes.is_empty() {
                (0..r).collect()
            } else {
                axes.iter()
                    .filter_map(|&a| crate::graph::infer::norm_axis(a, r))
                    .collect()
            };
            reduce::reduce(*kind, x(0)?, &axes, &mut outs[0])
        }
        Op::SoftmaxCrossEntropyLoss {
            reduction,
            ignore_index,
        } => reduce::softmax_cross_entropy(
            node,
            x(0)?,
            x(1)?,
            ins.get(2).copied().flatten(),
            *reduction,
            *ignore_index,
            outs,
        ),
        Op::Reshape { .. } | Op::Squeeze { .. } | Op::Unsqueeze { .. } | Op::Flatten { .. } => {
            outs[0].bytes_mut().copy_from_slice(x(0)?.bytes());
            Ok(())
        }
        Op::Transpose { perm } => shape::transpose(x(0)?, perm.as_deref(), &mut outs[0]),
        Op::Concat { axis } => shape::concat(ins, *axis, &mut outs[0]),
        Op::Split { axis, .. } => shape::split(x(0)?, *axis, outs),
        Op::Slice => shape::slice(x(0)?, ins, &mut outs[0]),
        Op::Expand => shape::expand(x(0)?, &mut outs[0]),
        Op::Gather { axis } => shape::gather(node, x(0)?, x(1)?, *axis, &mut outs[0]),
        Op::GatherElements { .. } | Op::GatherND { .. } => {
            shape::take(node, x(0)?, x(1)?, &mut outs[0])
        }
        Op::GatherElementsGrad { .. } | Op::GatherNDGrad { .. } => {
            shape::take_grad(node, x(0)?, x(1)?, &mut outs[0])
        }
        Op::Pad { .. } => shape::pad(node, x(0)?, ins, &mut outs[0]),
        Op::PadGrad { .. } => shape::pad_grad(node, x(0)?, ins, &mut outs[0]),
        Op::Conv { .. } => conv::conv(node, x(0)?, x(1)?, opt(2), &mut outs[0]),
        Op::FusedConv { activation, .. } => {
            let n = if want.get(1) == Some(&true) { 2 } else { 1 };
            conv::fused_conv(
                node,
                [x(0)?, x(1)?],
                opt(2),
                opt(3),
                *activation,
                &mut outs[..n],
            )
        }
        Op::ConvGrad { .. } => conv::conv_grad(node, x(0)?, x(1)?, x(2)?, outs, &want),
        Op::Im2Col { .. } => window::im2col(node, x(0)?, ins, &mut outs[0]),
        Op::Col2Im { .. } => window::col2im(node, x(0)?, ins, &mut outs[0]),
        Op::MaxPool { .. } => window::max_pool(node, x(0)?, &mut outs[0]),
        Op::MaxPoolGrad { .. } => window::max_pool_grad(node, x(0)?, x(1)?, &mut outs[0]),
        Op::ScatterElements { reduction, .. } | Op::ScatterND { reduction } => {
            shape::scatter(node, x(0)?, x(1)?, x(2)?, *reduction, &mut outs[0])
        }
        Op::Shape { start, end } => shape::shape(x(0)?, *start, *end, &mut outs[0]),
        Op::Constant { value } => {
            outs[0].bytes_mut().copy_from_slice(value.bytes());
            Ok(())
        }
        Op::Attention {
            is_causal, scale, ..
        } => attention::attention(
            node,
            [Some(x(0)?), opt(1), opt(2)],
            opt(3),
            *is_causal,
            *scale,
            outs,
        ),
        Op::VarlenAttention { is_causal, scale } => attention::varlen_attention(
            node,
            x(0)?,
            x(1)?,
            x(2)?,
            x(3)?,
            x(4)?,
            *is_causal,
            *scale,
            outs,
        ),
        // Gradient ops. Outputs named "" in the node are still allocated by the plan
        // (`outs` always has one tensor per output); `want(i)` says which are read.
        Op::UnaryGrad(u) => elementwise::unary_grad(*u, x(0)?, x(1)?, &mut outs[0]),
        Op::SoftmaxGrad { axis, log } => {
            reduce::softmax_grad(x(0)?, x(1)?, *axis, *log, &mut outs[0])
        }
        Op::LayerNormalizationGrad { axis, rms } => {
            let (m, i, r) = crate::graph::op::norm_grad_inputs(*rms);
            let mean = m.map(x).transpose()?;
            let res = ins.get(r).copied().flatten();
            reduce::layer_norm_grad(x(0)?, x(1)?, x(2)?, mean, x(i)?, res, *axis, &want, outs)
        }
        Op::SoftmaxCrossEntropyLossGrad {
            reduction,
            ignore_index,
        } => reduce::softmax_cross_entropy_grad(
            node,
            x(0)?,
            x(1)?,
            x(2)?,
            ins.get(3).copied().flatten(),
            *reduction,
            *ignore_index,
            &mut outs[0],
        ),
        Op::GatherGrad { axis } => shape::gather_grad(node, x(0)?, x(1)?, *axis, &mut outs[0]),
        Op::SliceGrad => shape::slice_grad(x(0)?, ins, &mut outs[0]),
        Op::FusedMatMulGrad {
            activation,
            trans_b,
            a_activation,
        } => matmul::fused_matmul_grad(
            x(0)?,
            x(1)?,
            x(2)?,
            ins.get(3).copied().flatten(),
            *activation,
            *trans_b,
            ins.get(4).copied().flatten().map(|p| (p, *a_activation)),
            &want,
            outs,
        ),
        Op::AttentionGrad {
            is_causal, scale, ..
        } => attention::attention_grad(
            node,
            x(0)?,
            [Some(x(1)?), opt(2), opt(3)],
            opt(6),
            x(4)?,
            x(5)?,
            *is_causal,
            *scale,
            &want,
            outs,
        ),
        Op::VarlenAttentionGrad { is_causal, scale } => attention::varlen_attention_grad(
            node,
            [x(0)?, x(1)?, x(2)?, x(3)?],
            x(4)?,
            x(5)?,
            x(6)?,
            x(7)?,
            *is_causal,
            *scale,
            &want,
            outs,
        ),
    }
}

/// Evaluates one node on the host given its inferred types (used by inference to fold
/// shape arithmetic, and by tests).
pub fn eval_node_with_types(
    node: &Node,
    ins: &[Option<&Tensor>],
    out_types: &[ValueType],
) -> Result<Vec<Tensor>> {
    let mut outs: Vec<Tensor> = out_types
        .iter()
        .map(|t| Tensor::zeros(t.dtype, &t.shape))
        .collect();
    run_node(node, ins, &mut outs, 0)?;
    Ok(outs)
}

/// Infers and evaluates one node on host tensors: the simplest way to run an op.
pub fn eval_node(node: &Node, ins: &[Option<&Tensor>]) -> Result<Vec<Tensor>> {
    let types: Vec<Option<ValueType>> = ins
        .iter()
        .map(|t| t.map(|t| ValueType::new(t.dtype(), t.shape())))
        .collect();
    let tref: Vec<Option<&ValueType>> = types.iter().map(|t| t.as_ref()).collect();
    let outs = crate::graph::infer::infer_node(node, &tref, ins, &HOST_EVAL)?;
    eval_node_with_types(node, ins, &outs)
}

/// The reference host evaluator: the CPU kernels, for inference (shape arithmetic, NonZero
/// and Unique) and constant folding.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuEval;

/// The evaluator the executor, the loaders and the passes' defaults use.
pub static HOST_EVAL: CpuEval = CpuEval;

impl HostEval for CpuEval {
    fn eval(
        &self,
        node: &Node,
        args: &[Option<&Tensor>],
        outs: &[ValueType],
    ) -> Result<Vec<Tensor>> {
        eval_node_with_types(node, args, outs)
    }
    fn eval_data_shaped(
        &self,
        op: &Op,
        xs: &[Option<&Tensor>],
    ) -> std::result::Result<Vec<Tensor>, String> {
        data_shaped::eval(op, xs)
    }
}
