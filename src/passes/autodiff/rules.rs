//! Gradient rules: one function per op family, dispatched by `grad` on the closed `Op`
//! enum (so a new op cannot be added without deciding its gradient). A rule gets the
//! forward node and the gradients of its outputs (`None` where no gradient reached an
//! output) and returns, per input, the value holding that input's gradient, built from
//! new nodes. Rules only compute what is needed: `b.needs(input)` says whether anyone
//! wants an input's gradient.

use super::Builder;
use crate::error::Result;
use crate::graph::{BinaryOp as B, Node, Op, PadMode, ReduceKind, ScatterReduction, UnaryOp};

type Grads = Vec<Option<String>>;

/// Conv's (and FusedConv's, given G) gradients: dX and dW from one ConvGrad (each only
/// when needed), dB = dY summed over every axis but the channels.
fn conv(b: &mut Builder, n: &Node, dy: &str) -> Result<Grads> {
    let (xv, w) = (&n.inputs[0], &n.inputs[1]);
    let op = n.op.grad_op().expect("Conv has a gradient op");
    let mut out = if b.needs(xv) || b.needs(w) {
        fused_grads(b, op, &[dy, xv, w], &[xv, w], n.inputs.len())?
    } else {
        vec![None; n.inputs.len()]
    };
    if let Some(bias) = n.inputs.get(2).filter(|v| b.needs(v)) {
        let r = b.shape(dy).len() as i64;
        let last = matches!(&n.op, Op::Conv { window, .. } | Op::FusedConv { window, .. } if window.channels_last);
        // Every axis but the channels': 1, or the last one channels-last.
        let axes = match last {
            true => (0..r - 1).collect(),
            false => std::iter::once(0).chain(2..r).collect(),
        };
        let sum = Op::Reduce {
            kind: ReduceKind::Sum,
            axes: Some(axes),
            keepdims: false,
            noop_with_empty_axes: false,
        };
        out[2] = Some(b.op1(sum, &[dy], &format!("{bias}.d"))?);
    }
    Ok(out)
}

pub(super) fn grad(b: &mut Builder, ni: usize, n: &Node, dys: &[Option<String>]) -> Result<Grads> {
    let none = || Ok(vec![None; n.inputs.len()]);
    // Most ops have one output; its gradient.
    let Some(dy) = dys[0].clone() else {
        return multi(b, ni, n, dys);
    };
    let x = n.inputs.first().cloned().unwrap_or_default();
    match &n.op {
        Op::Unary(u) => {
            let g = match u {
                _ if !u.differentiable() => return none(),
                UnaryOp::Neg => b.un(Op::Unary(UnaryOp::Neg), &dy)?,
                _ => b.op1(Op::UnaryGrad(*u), &[&dy, &x], &format!("{x}.d"))?,
            };
            Ok(vec![Some(g)])
        }
        Op::Binary(op) => binary(b, n, *op, &dy),
        Op::Clip => clip(b, n, &dy),
        Op::Where => {
            let (c, l, r) = (&n.inputs[0], &n.inputs[1], &n.inputs[2]);
            let z = b.scalar(b.dtype(&dy), 0.0)?;
            let mut out = vec![None, None, None];
            if b.needs(l) {
                let w = b.op1(Op::Where, &[c, &dy, &z], &format!("{l}.d"))?;
                out[1] = Some(b.sum_to(&w, &b.shape(l))?);
            }
            if b.needs(r) {
                let w = b.op1(Op::Where, &[c, &z, &dy], &format!("{r}.d"))?;
                out[2] = Some(b.sum_to(&w, &b.shape(r))?);
            }
            Ok(out)
        }
        Op::Cast { .. } | Op::CastLike => {
            let from = b.dtype(&x);
            if !from.is_float() {
                return none();
            }
            let mut out = vec![None; n.inputs.len()];
            out[0] = Some(b.un(Op::Cast { to: from }, &dy)?);
            Ok(out)
        }
        Op::Identity => Ok(vec![Some(dy)]),
        Op::Reshape { .. } | Op::Flatten { .. } | Op::Squeeze { .. } | Op::Unsqueeze { .. } => {
            let mut out = vec![None; n.inputs.len()];
            out[0] = Some(b.reshape(&dy, &b.shape(&x))?);
            Ok(out)
        }
        Op::Transpose { perm } => {
            let r = b.shape(&x).len();
            let perm = perm.clone().unwrap_or_else(|| (0..r).rev().collect());
            let mut inv = vec![0; r];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            Ok(vec![Some(b.transpose(&dy, inv)?)])
        }
        Op::Expand => Ok(vec![Some(b.sum_to(&dy, &b.shape(&x))?), None]),
        Op::Concat { axis } => {
            let r = b.shape(&dy).len();
            let a = crate::graph::infer::norm_axis(*axis, r).expect("inferred");
            let sizes: Vec<i64> = n.inputs.iter().map(|i| b.shape(i)[a] as i64).collect();
            let outs: Vec<String> = n.inputs.iter().map(|i| format!("{i}.d")).collect();
            let outs: Vec<&str> = outs.iter().map(|s| s.as_str()).collect();
            let op = Op::Split {
                axis: *axis,
                split: Some(sizes),
                num_outputs: None,
            };
            let parts = b.node(op, &[&dy], &outs)?;
            Ok(parts.into_iter().map(Some).collect())
        }
        Op::Slice => {
            let xs = b.shape_const(&b.shape(&x))?;
            let mut ins: Vec<&str> = vec![&dy, &xs];
            ins.extend(n.inputs[1..].iter().map(|s| s.as_str()));
            let g = b.op1(Op::SliceGrad, &ins, &format!("{x}.d"))?;
            let mut out = vec![None; n.inputs.len()];
            out[0] = Some(g);
            Ok(out)
        }
        Op::Gather { .. } | Op::GatherElements { .. } | Op::GatherND { .. } => {
            let xs = b.shape_const(&b.shape(&x))?;
            let op = n.op.grad_op().expect("gathers have gradient ops");
            let g = b.op1(op, &[&dy, &n.inputs[1], &xs], &format!("{x}.d"))?;
            Ok(vec![Some(g), None])
        }
        Op::Im2Col { kernel, window, .. } => {
            let mut out = vec![None; n.inputs.len()];
            let block = window_dims(b, kernel, n.inputs.get(1))?;
            let ys = b.shape(&dy);
            let cols = b.reshape(&dy, &[ys[0], ys[1], ys[2..].iter().product()])?;
            let image: Vec<i64> = b.shape(&x)[2..].iter().map(|&d| d as i64).collect();
            let image = b.i64s(&image)?;
            let op = Op::Col2Im {
                block,
                window: window.clone(),
            };
            out[0] = Some(b.op1(op, &[&cols, &image], &format!("{x}.d"))?);
            Ok(out)
        }
        Op::MaxPool { .. } => {
            let op = n.op.grad_op().expect("MaxPool has a gradient op");
            Ok(vec![Some(b.op1(op, &[&dy, &x], &format!("{x}.d"))?)])
        }
        Op::Conv { .. } => conv(b, n, &dy),
        Op::FusedConv { activation, .. } => {
            // G = dY·act'(Pre) (Relu's read from Y: Y > 0 exactly where Pre > 0); then
            // Conv's gradients of G, and Z's is G itself.
            let y = &n.outputs[0];
            let g = match activation.unary() {
                // Relu6's derivative is 1 where 0 < Y < 6, read from Y as Relu's.
                None if *activation == crate::graph::Activation::Relu6 => {
                    let dt = b.dtype(&dy);
                    let (zero, six) = (b.scalar(dt, 0.0)?, b.scalar(dt, 6.0)?);
                    let above = b.bin(B::Greater, y, &zero)?;
                    let below = b.bin(B::Less, y, &six)?;
                    let inside = b.bin(B::And, &above, &below)?;
                    b.op1(Op::Where, &[&inside, &dy, &zero], &format!("{y}.dpre"))?
                }
                None => dy.clone(),
                Some(u @ UnaryOp::Relu) => {
                    b.op1(Op::UnaryGrad(u), &[&dy, y], &format!("{y}.dpre"))?
                }
                Some(u) => {
                    let pre = b.aux_output(ni, 1, "pre")?;
                    b.op1(Op::UnaryGrad(u), &[&dy, &pre], &format!("{y}.dpre"))?
                }
            };
            let mut out = conv(b, n, &g)?;
            if let Some(z) = n.inputs.get(3).filter(|v| b.needs(v)) {
                out[3] = Some(b.sum_to(&g, &b.shape(z))?);
            }
            Ok(out)
        }
        Op::Col2Im { block, window } => {
            let mut out = vec![None; n.inputs.len()];
            let kernel = window_dims(b, block, n.inputs.get(2))?;
            let op = Op::Im2Col {
                kernel,
                window: window.clone(),
                pad_value: 0.0,
                beyond_value: 0.0,
            };
            let cols = b.op1(op, &[&dy], &format!("{x}.d"))?;
            out[0] = Some(b.reshape(&cols, &b.shape(&x))?);
            Ok(out)
        }
        Op::Pad { mode } => {
            let mut out = vec![None; n.inputs.len()];
            let mut ins: Vec<&str> = vec![&dy, &n.inputs[1]];
            if let Some(axes) = n.inputs.get(3).filter(|a| !a.is_empty()) {
                ins.push(axes);
            }
            let dx = b.op1(Op::PadGrad { mode: *mode }, &ins, &format!("{x}.d"))?;
            // The constant's gradient: what dY holds beyond what reached X.
            if let Some(c) = n
                .inputs
                .get(2)
                .filter(|c| *mode == PadMode::Constant && b.needs(c))
            {
                let all = |b: &mut Builder, v: &str| {
                    b.un(
                        Op::Reduce {
                            kind: ReduceKind::Sum,
                            axes: None,
                            keepdims: false,
                            noop_with_empty_axes: false,
                        },
                        v,
                    )
                };
                let (sy, sx) = (all(b, &dy)?, all(b, &dx)?);
                let d = b.bin(B::Sub, &sy, &sx)?;
                out[2] = Some(b.reshape(&d, &b.shape(c))?);
            }
            out[0] = Some(dx);
            Ok(out)
        }
        Op::ScatterElements { reduction, .. } | Op::ScatterND { reduction } => {
            let (idx, upd) = (&n.inputs[1], &n.inputs[2]);
            let gather = match n.op {
                Op::ScatterElements { axis, .. } => Op::GatherElements { axis },
                _ => Op::GatherND { batch_dims: 0 },
            };
            let mut out = vec![None, None, None];
            match reduction {
                // Written-over elements get no gradient; each update gets dY where it landed.
                ScatterReduction::None => {
                    if b.needs(&x) {
                        let ty = b.ty(upd).clone();
                        let z = b.zeros(&ty)?;
                        out[0] = Some(b.op1(n.op.clone(), &[&dy, idx, &z], &format!("{x}.d"))?);
                    }
                }
                ScatterReduction::Add => out[0] = Some(dy.clone()),
                r => crate::bail!(
                    Graph,
                    "{}: no gradient for reduction '{}' (only none and add are differentiable here)",
                    n.describe(),
                    r.name()
                ),
            }
            if b.needs(upd) {
                out[2] = Some(b.op1(gather, &[&dy, idx], &format!("{upd}.d"))?);
            }
            Ok(out)
        }
        // The sum runs the other way: each dy reaches every x that went into it.
        Op::Cumulative {
            prod: false,
            exclusive,
            reverse,
        } => {
            let op = Op::Cumulative {
                prod: false,
                exclusive: *exclusive,
                reverse: !reverse,
            };
            let g = b.op1(op, &[&dy, &n.inputs[1]], &format!("{x}.d"))?;
            Ok(vec![Some(g), None])
        }
        Op::Cumulative {
            prod: true,
            exclusive,
            reverse,
        } => Ok(vec![Some(cumprod(b, n, &dy, *exclusive, *reverse)?), None]),
        // Each value is the element at its index: its gradient goes back there.
        Op::TopK { axis, .. } => {
            let idx = b.aux_output(ni, 1, "indices")?;
            let xs = b.shape_const(&b.shape(&x))?;
            let op = Op::GatherElementsGrad { axis: *axis };
            let g = b.op1(op, &[&dy, &idx, &xs], &format!("{x}.d"))?;
            Ok(vec![Some(g), None])
        }
        Op::Trilu { upper } => {
            let mut ins: Vec<&str> = vec![&dy];
            ins.extend(n.inputs.get(1).map(|s| s.as_str()));
            let g = b.op1(Op::Trilu { upper: *upper }, &ins, &format!("{x}.d"))?;
            let mut out = vec![None; n.inputs.len()];
            out[0] = Some(g);
            Ok(out)
        }
        Op::Rotary { interleaved } => {
            // Y = X·Cos + rot(X)·Sin is linear in each input: dX = dY·Cos − rot(dY·Sin)
            // (one RotaryGrad), dCos = Σ dY·X and dSin = Σ dY·rot(X) over the broadcast,
            // with rot(X) = Rotary(X, 0, 1).
            let (cos, sin) = (&n.inputs[1], &n.inputs[2]);
            let mut out = vec![None; 3];
            if b.needs(&x) {
                let op = Op::RotaryGrad {
                    interleaved: *interleaved,
                };
                out[0] = Some(b.op1(op, &[&dy, cos, sin], &format!("{x}.d"))?);
            }
            if b.needs(cos) {
                let g = b.bin(B::Mul, &dy, &x)?;
                out[1] = Some(b.sum_to(&g, &b.shape(cos))?);
            }
            if b.needs(sin) {
                let dt = b.dtype(&x);
                let (zero, one) = (b.scalar(dt, 0.0)?, b.scalar(dt, 1.0)?);
                let op = Op::Rotary {
                    interleaved: *interleaved,
                };
                let r = b.op1(op, &[&x, &zero, &one], &format!("{x}.rot"))?;
                let g = b.bin(B::Mul, &dy, &r)?;
                out[2] = Some(b.sum_to(&g, &b.shape(sin))?);
            }
            Ok(out)
        }
        Op::MatMul => matmul(b, n, &dy),
        Op::Gemm {
            alpha,
            beta,
            trans_a,
            trans_b,
        } => gemm(b, n, &dy, *alpha, *beta, *trans_a, *trans_b),
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let log = matches!(n.op, Op::LogSoftmax { .. });
            let g = b.op1(
                Op::SoftmaxGrad { axis: *axis, log },
                &[&dy, &n.outputs[0]],
                &format!("{x}.d"),
            )?;
            Ok(vec![Some(g)])
        }
        Op::Reduce {
            kind,
            axes,
            keepdims: _,
            noop_with_empty_axes,
        } => reduce(b, n, &dy, *kind, axes.clone(), *noop_with_empty_axes),
        Op::Dropout { ratio, .. } => {
            let mut out = vec![None; n.inputs.len()];
            let dt = b.dtype(&dy);
            let ratio_in = n.inputs.get(1).filter(|s| !s.is_empty()).cloned();
            let ratio = match &ratio_in {
                None => Some(*ratio as f64),
                Some(r) => b.konst(r).map(|t| t.to_f64_vec()[0]),
            };
            // Whether the forward applies the mask: always in a training backward graph
            // (see below), else as its training_mode input says (None: at run time).
            let tm = n.inputs.get(2).filter(|s| !s.is_empty()).cloned();
            let applies = if b.training() {
                Some(true)
            } else {
                match &tm {
                    None => Some(false),
                    Some(t) => b.konst(t).map(|t| t.to_f64_vec()[0] != 0.0),
                }
            };
            if applies == Some(false) || ratio == Some(0.0) {
                out[0] = Some(dy);
                return Ok(out);
            }
            if b.training() {
                // The gradient below assumes the mask was applied, but the backend may
                // run in inference mode (`train_step` on a session made without
                // `training`): the forward node is told to train by its training_mode.
                b.force_training_mode(ni)?;
            }
            let mask = b.aux_output(ni, 1, "mask")?;
            // dX = dY · mask / (1 − ratio) where the mask applies; where it does not, the
            // mask is all true and the scale 1.
            let s = match (ratio, &ratio_in) {
                (Some(r), _) => b.scalar(dt, 1.0 / (1.0 - r))?,
                (None, Some(r)) => {
                    let r = if b.dtype(r) == dt {
                        r.clone()
                    } else {
                        b.un(Op::Cast { to: dt }, r)?
                    };
                    let one = b.scalar(dt, 1.0)?;
                    let keep = b.bin(B::Sub, &one, &r)?;
                    b.bin(B::Div, &one, &keep)?
                }
                (None, None) => unreachable!("a ratio that is not an input is known"),
            };
            let s = match (applies, &tm) {
                (None, Some(t)) => {
                    let one = b.scalar(dt, 1.0)?;
                    b.op1(Op::Where, &[t, &s, &one], &format!("{x}.scale"))?
                }
                _ => s,
            };
            let scaled = b.bin(B::Mul, &dy, &s)?;
            let z = b.scalar(dt, 0.0)?;
            out[0] = Some(b.op1(Op::Where, &[&mask, &scaled, &z], &format!("{x}.d"))?);
            Ok(out)
        }
        Op::FusedMatMul {
            activation,
            trans_b,
        } => {
            let (a, w) = (&n.inputs[0], &n.inputs[1]);
            let bias = n.inputs.get(2).filter(|s| !s.is_empty());
            let res = n.inputs.get(3).filter(|s| !s.is_empty());
            let mut ins: Vec<String> = vec![dy.clone(), a.clone(), w.clone()];
            if *activation != crate::graph::Activation::None {
                ins.push(b.aux_output(ni, 1, "pre")?);
            }
            let ins: Vec<&str> = ins.iter().map(|s| s.as_str()).collect();
            let mut of: Vec<&str> = vec![a, w];
            of.extend(bias.map(|s| s.as_str()));
            let op = Op::FusedMatMulGrad {
                activation: *activation,
                trans_b: *trans_b,
                a_activation: crate::graph::Activation::None,
            };
            let mut out = fused_grads(b, op, &ins, &of, n.inputs.len())?;
            if let Some(r) = res.filter(|r| b.needs(r)) {
                out[3] = Some(b.sum_to(&dy, &b.shape(r))?);
            }
            Ok(out)
        }
        Op::GatedMatMul { .. } => gated(b, ni, n, dys),
        Op::Attention { .. } => {
            let lse = b.aux_output(ni, 1, "lse")?;
            let mask = n.inputs.get(3).cloned().unwrap_or_default();
            let mask_grad = b.needs(&mask);
            let mut ins = vec![
                dy.as_str(),
                &n.inputs[0],
                &n.inputs[1],
                &n.inputs[2],
                &n.outputs[0],
                &lse,
            ];
            if !mask.is_empty() {
                ins.push(&mask);
            }
            let mut of: Vec<&str> = n.inputs[..3].iter().map(|s| s.as_str()).collect();
            if mask_grad {
                of.push(&mask);
            }
            let op = n.op.grad_op().expect("Attention has a gradient op");
            let mut out = fused_grads(b, op, &ins, &of, n.inputs.len())?;
            if let Some(dm) = out.get(3).cloned().flatten() {
                out[3] = Some(b.sum_to(&dm, &b.shape(&mask))?);
            }
            Ok(out)
        }
        Op::VarlenAttention { is_causal, scale } => {
            let lse = b.aux_output(ni, 1, "lse")?;
            let mut ins: Vec<&str> = vec![&dy];
            ins.extend(n.inputs.iter().map(|s| s.as_str()));
            ins.push(&n.outputs[0]);
            ins.push(&lse);
            let of: Vec<&str> = n.inputs[..3].iter().map(|s| s.as_str()).collect();
            let op = Op::VarlenAttentionGrad {
                is_causal: *is_causal,
                scale: *scale,
            };
            fused_grads(b, op, &ins, &of, n.inputs.len())
        }
        // No gradient flows through integer results, shapes, constants or random draws
        // (a `Like` draw reads only its input's shape).
        Op::Shape { .. }
        | Op::Constant { .. }
        | Op::Range
        | Op::ArgReduce { .. }
        | Op::NonZero
        | Op::Unique { .. }
        | Op::NonMaxSuppression { .. }
        | Op::BitCast { .. }
        | Op::ResizeMatrix { .. }
        | Op::Random { .. } => none(),
        // Multi-output ops are handled by `multi`; gradient ops are not differentiated again.
        Op::Split { .. }
        | Op::LayerNormalization { .. }
        | Op::SoftmaxCrossEntropyLoss { .. }
        | Op::UnaryGrad(_)
        | Op::SoftmaxGrad { .. }
        | Op::LayerNormalizationGrad { .. }
        | Op::SoftmaxCrossEntropyLossGrad { .. }
        | Op::GatherGrad { .. }
        | Op::GatherElementsGrad { .. }
        | Op::GatherNDGrad { .. }
        | Op::SliceGrad
        | Op::PadGrad { .. }
        | Op::FusedMatMulGrad { .. }
        | Op::GatedMatMulGrad { .. }
        | Op::AttentionGrad { .. }
        | Op::VarlenAttentionGrad { .. }
        | Op::RotaryGrad { .. }
        | Op::ConvGrad { .. }
        | Op::MaxPoolGrad { .. } => multi(b, ni, n, dys),
    }
}

/// A window's kernel dims: the op's attribute, else its plan-time input's value.
fn window_dims(b: &Builder, attr: &[usize], input: Option<&String>) -> Result<Vec<usize>> {
    if !attr.is_empty() {
        return Ok(attr.to_vec());
    }
    match input.and_then(|v| b.konst(v)) {
        Some(t) => Ok(t.to_i64_vec().iter().map(|&d| d.max(1) as usize).collect()),
        None => crate::bail!(
            Graph,
            "a window's kernel dims must be known when the backward graph is built"
        ),
    }
}

/// A fused gradient node whose outputs are the gradients of `of` (in order), each named
/// only where that gradient is wanted (the kernel skips the others); the result is indexed
/// like the forward node's `n_inputs` inputs, `of` being its first ones.
fn fused_grads(
    b: &mut Builder,
    op: Op,
    ins: &[&str],
    of: &[&str],
    n_inputs: usize,
) -> Result<Grads> {
    let outs: Vec<String> = of
        .iter()
        .map(|v| {
            if b.needs(v) {
                format!("{v}.d")
            } else {
                String::new()
            }
        })
        .collect();
    let outs: Vec<&str> = outs.iter().map(|s| s.as_str()).collect();
    let mut out: Grads = b
        .node(op, ins, &outs)?
        .into_iter()
        .map(|v| Some(v).filter(|v| !v.is_empty()))
        .collect();
    out.resize(n_inputs, None);
    Ok(out)
}

/// GatedMatMul's gradients: dG and dU from one GatedMatMulGrad (plus any gradient that
/// reached G or U as outputs), then each product's dA, dW and dBias from a
/// FusedMatMulGrad, the two dA summed.
fn gated(b: &mut Builder, ni: usize, n: &Node, dys: &[Option<String>]) -> Result<Grads> {
    let Op::GatedMatMul { trans_b, .. } = n.op else {
        unreachable!("gated() is GatedMatMul's rule")
    };
    let a = n.inputs[0].as_str();
    let dy = match &dys[0] {
        Some(d) => d.clone(),
        None => {
            let ty = b.ty(&n.outputs[0]).clone();
            b.zeros(&ty)?
        }
    };
    let g = b.aux_output(ni, 1, "gate")?;
    let u = b.aux_output(ni, 2, "up")?;
    let op = n.op.grad_op().expect("GatedMatMul has a gradient op");
    let d = b.node(op, &[&dy, &g, &u], &[&format!("{g}.d"), &format!("{u}.d")])?;
    let mut out = vec![None; n.inputs.len()];
    let mut da = vec![];
    for (k, (w, bias)) in [(1, 3), (2, 4)].into_iter().enumerate() {
        let mut dk = d[k].clone();
        if let Some(extra) = dys.get(k + 1).cloned().flatten() {
            dk = b.bin(B::Add, &dk, &extra)?;
        }
        let wv = n.inputs[w].as_str();
        let bias_v = n.inputs.get(bias).filter(|s| !s.is_empty());
        let mut of = vec![a, wv];
        of.extend(bias_v.map(|s| s.as_str()));
        let fop = Op::FusedMatMulGrad {
            activation: crate::graph::Activation::None,
            trans_b,
            a_activation: crate::graph::Activation::None,
        };
        let r = fused_grads(b, fop, &[&dk, a, wv], &of, 3)?;
        da.extend(r[0].clone());
        out[w] = r[1].clone();
        if bias_v.is_some() {
            out[bias] = r[2].clone();
        }
    }
    out[0] = match da.as_slice() {
        [] => None,
        [x] => Some(x.clone()),
        [x, y] => Some(b.bin(B::Add, x, y)?),
        _ => unreachable!("two products"),
    };
    Ok(out)
}

/// Ops with several outputs (their rule looks at every output's gradient), and ops
/// that have no rule.
fn multi(b: &mut Builder, ni: usize, n: &Node, dys: &[Option<String>]) -> Result<Grads> {
    let mut out = vec![None; n.inputs.len()];
    match &n.op {
        Op::GatedMatMul { .. } => return gated(b, ni, n, dys),
        Op::Split { axis, .. } => {
            let x = &n.inputs[0];
            let mut parts = vec![];
            for (o, d) in n.outputs.iter().zip(dys) {
                parts.push(match d {
                    Some(d) => d.clone(),
                    None => {
                        let ty = b.ty(o).clone();
                        b.zeros(&ty)?
                    }
                });
            }
            let parts: Vec<&str> = parts.iter().map(|s| s.as_str()).collect();
            out[0] = Some(b.op1(Op::Concat { axis: *axis }, &parts, &format!("{x}.d"))?);
        }
        Op::LayerNormalization {
            axis,
            rms,
            residual,
            ..
        } => {
            use crate::graph::op::{norm_optional_inputs, norm_stat_outputs, norm_sum_output};
            let scale = &n.inputs[1];
            let (bi, ri) = norm_optional_inputs(*rms, *residual);
            let bias = bi.and_then(|k| n.inputs.get(k).filter(|s| !s.is_empty()).cloned());
            let (m, i) = norm_stat_outputs(*rms);
            let mean = m.map(|m| b.aux_output(ni, m, "mean")).transpose()?;
            let inv = b.aux_output(ni, i, "inv_std")?;
            // The rows normalized: X, or with a residual the sum S = X + R (an output,
            // kept for the backward), whose own gradient dS joins the normalization's and
            // goes to X and R alike.
            let (x, ds, r) = match ri {
                Some(ri) => {
                    let k = norm_sum_output(*rms);
                    let s = b.aux_output(ni, k, "sum")?;
                    (s, dys.get(k).cloned().flatten(), Some(n.inputs[ri].clone()))
                }
                None => (n.inputs[0].clone(), None, None),
            };
            let want_x = b.needs(&n.inputs[0]) || r.as_ref().is_some_and(|r| b.needs(r));
            let mut dx = None;
            if let Some(dy) = &dys[0] {
                let name = |v: &str, want: bool| match want {
                    true => format!("{v}.d"),
                    false => String::new(),
                };
                let mut outs = vec![name(&x, want_x), name(scale, b.needs(scale))];
                if let Some(bi) = &bias {
                    outs.push(name(bi, b.needs(bi)));
                }
                let outs: Vec<&str> = outs.iter().map(|s| s.as_str()).collect();
                let mut ins: Vec<&str> = vec![dy, &x, scale];
                ins.extend(mean.as_deref());
                ins.push(&inv);
                // dS is added as dX is written (the `ln_grad_residual` form).
                ins.extend(ds.as_deref().filter(|_| want_x));
                let op = Op::LayerNormalizationGrad {
                    axis: *axis,
                    rms: *rms,
                };
                let g = b.node(op, &ins, &outs)?;
                dx = Some(g[0].clone()).filter(|v| !v.is_empty());
                if !g[1].is_empty() {
                    out[1] = Some(b.sum_to(&g[1], &b.shape(scale))?);
                }
                if let (Some(bi), Some(d)) = (&bias, g.get(2).filter(|v| !v.is_empty())) {
                    out[2] = Some(b.sum_to(d, &b.shape(bi))?);
                }
            } else if want_x {
                dx = ds;
            }
            let dy = |k: usize| dys.get(k).cloned().flatten();
            let (dmean, dinv) = (m.and_then(dy), dy(i));
            if want_x && (dmean.is_some() || dinv.is_some()) {
                let stats =
                    layer_norm_stats_grad(b, *axis, &x, mean.as_deref(), &inv, dmean, dinv)?;
                dx = Some(match dx.take() {
                    Some(d) => b.bin(B::Add, &d, &stats)?,
                    None => stats,
                });
            }
            if b.needs(&n.inputs[0]) {
                out[0] = dx.clone();
            }
            if let Some(ri) = ri.filter(|&k| b.needs(&n.inputs[k])) {
                out[ri] = dx;
            }
        }
        Op::SoftmaxCrossEntropyLoss {
            reduction,
            ignore_index,
        } => {
            let scores = &n.inputs[0];
            let weights = n.inputs.get(2).filter(|s| !s.is_empty()).cloned();
            if b.needs(scores) {
                let mut parts = vec![];
                if let Some(dl) = &dys[0] {
                    let mut ins: Vec<&str> = vec![dl, scores, &n.inputs[1]];
                    ins.extend(weights.as_deref());
                    let op = Op::SoftmaxCrossEntropyLossGrad {
                        reduction: *reduction,
                        ignore_index: *ignore_index,
                    };
                    parts.push(b.op1(op, &ins, &format!("{scores}.d"))?);
                }
                if let Some(dlp) = dys.get(1).cloned().flatten() {
                    // log_prob = LogSoftmax(scores, axis 1).
                    let op = Op::SoftmaxGrad { axis: 1, log: true };
                    parts.push(b.op1(op, &[&dlp, &n.outputs[1]], &format!("{scores}.d"))?);
                }
                let mut it = parts.into_iter();
                let mut s = it.next().expect("some output has a gradient");
                for p in it {
                    s = b.bin(B::Add, &s, &p)?;
                }
                out[0] = Some(s);
            }
            // log_prob does not depend on the weights: only the loss' gradient reaches them.
            if let (Some(w), Some(dl)) = (weights.filter(|w| b.needs(w)), &dys[0]) {
                out[2] = Some(sce_weights_grad(b, n, dl, *reduction, *ignore_index, &w)?);
            }
        }
        Op::Dropout { .. } | Op::TopK { .. } => {
            // Only the mask (indices) output got a gradient: nothing flows to the data.
        }
        op => crate::bail!(
            Graph,
            "{} has no gradient rule (it is not differentiated again)",
            op.name()
        ),
    }
    Ok(out)
}

/// The part of LayerNormalization's dX that comes through its Mean and InvStdDev outputs
/// (computed in their statistics dtype): with N the normalized size and xc = X − Mean,
/// dX = dMean/N − dInvStdDev·InvStdDev³·xc/N (the variance's own mean term cancels).
/// RMSNormalization (no `mean`) has xc = X.
fn layer_norm_stats_grad(
    b: &mut Builder,
    axis: i64,
    x: &str,
    mean: Option<&str>,
    inv: &str,
    dmean: Option<String>,
    dinv: Option<String>,
) -> Result<String> {
    let sx = b.shape(x);
    let a = crate::graph::infer::norm_axis(axis, sx.len()).expect("inferred");
    let count: usize = sx[a..].iter().product();
    let (dt, sd) = (b.dtype(x), b.dtype(inv));
    let k = b.scalar(sd, 1.0 / count.max(1) as f64)?;
    let mut parts = vec![];
    if let Some(dm) = dmean {
        let t = b.bin(B::Mul, &dm, &k)?;
        let xs = b.shape_const(&sx)?;
        let h = b.hint();
        parts.push(b.op1(Op::Expand, &[&t, &xs], &h)?);
    }
    if let Some(di) = dinv {
        let xf = if dt == sd {
            x.to_string()
        } else {
            b.un(Op::Cast { to: sd }, x)?
        };
        let xc = match mean {
            Some(m) => b.bin(B::Sub, &xf, m)?,
            None => xf,
        };
        let i2 = b.bin(B::Mul, inv, inv)?;
        let i3 = b.bin(B::Mul, &i2, inv)?;
        let c = b.bin(B::Mul, &di, &i3)?;
        let c = b.bin(B::Mul, &c, &k)?;
        let t = b.bin(B::Mul, &xc, &c)?;
        parts.push(b.un(Op::Unary(UnaryOp::Neg), &t)?);
    }
    let mut it = parts.into_iter();
    let mut s = it.next().expect("some statistic has a gradient");
    for p in it {
        s = b.bin(B::Add, &s, &p)?;
    }
    if dt != sd {
        s = b.un(Op::Cast { to: dt }, &s)?;
    }
    Ok(s)
}

/// The gradient of SoftmaxCrossEntropyLoss' class weights: a scatter-add over the labels
/// (GatherGrad into `[C]`) of v_i = dL_i·nll_i (none), dL·nll_i (sum) or
/// dL·(nll_i − L)/W (mean, W = Σ_i w[l_i]), where nll_i is element i's unweighted loss and
/// ignored elements contribute 0.
fn sce_weights_grad(
    b: &mut Builder,
    n: &Node,
    dl: &str,
    reduction: crate::graph::op::LossReduction,
    ignore_index: Option<i64>,
    w: &str,
) -> Result<String> {
    use crate::graph::op::LossReduction as R;
    let (scores, labels) = (&n.inputs[0], &n.inputs[1]);
    let dt = b.dtype(scores);
    let lt = b.dtype(labels);
    let h = format!("{w}.d");
    // An ignored label may be out of range: read class 0 there instead, weighted by 0.
    let (safe, valid) = match ignore_index {
        Some(ii) => {
            let iiv = b.constant(crate::tensor::Tensor::from_f64(lt, &[], &[ii as f64])?)?;
            let hit = b.bin(B::Equal, labels, &iiv)?;
            let zl = b.constant(crate::tensor::Tensor::from_f64(lt, &[], &[0.0])?)?;
            let safe = b.op1(Op::Where, &[&hit, &zl, labels], &h)?;
            let (z, one) = (b.scalar(dt, 0.0)?, b.scalar(dt, 1.0)?);
            let valid = b.op1(Op::Where, &[&hit, &z, &one], &h)?;
            (safe, Some(valid))
        }
        None => (labels.clone(), None),
    };
    let op = Op::SoftmaxCrossEntropyLoss {
        reduction: R::None,
        ignore_index: None,
    };
    let nll = b.op1(op, &[scores, &safe], &h)?;
    let mut v = match reduction {
        R::Mean => b.bin(B::Sub, &nll, &n.outputs[0])?,
        R::Sum | R::None => nll,
    };
    if let Some(m) = &valid {
        v = b.bin(B::Mul, &v, m)?;
    }
    v = b.bin(B::Mul, &v, dl)?;
    if reduction == R::Mean {
        let mut wi = b.op1(Op::Gather { axis: 0 }, &[w, &safe], &h)?;
        if let Some(m) = &valid {
            wi = b.bin(B::Mul, &wi, m)?;
        }
        let all = Op::Reduce {
            kind: ReduceKind::Sum,
            axes: None,
            keepdims: false,
            noop_with_empty_axes: false,
        };
        let total = b.un(all, &wi)?;
        v = b.bin(B::Div, &v, &total)?;
    }
    let ws = b.shape_const(&b.shape(w))?;
    b.op1(Op::GatherGrad { axis: 0 }, &[&v, &safe, &ws], &h)
}

fn binary(b: &mut Builder, n: &Node, op: B, dy: &str) -> Result<Grads> {
    let (x, y) = (&n.inputs[0], &n.inputs[1]);
    let (wx, wy) = (b.needs(x), b.needs(y));
    let mut out = vec![None, None];
    let to = |b: &mut Builder, g: String, v: &str| -> Result<Option<String>> {
        let s = b.shape(v);
        Ok(Some(b.sum_to(&g, &s)?))
    };
    match op {
        B::Add | B::Sub => {
            if wx {
                out[0] = to(b, dy.to_string(), x)?;
            }
            if wy {
                let g = if op == B::Sub {
                    b.un(Op::Unary(UnaryOp::Neg), dy)?
                } else {
                    dy.to_string()
                };
                out[1] = to(b, g, y)?;
            }
        }
        B::Mul if x == y => {
            // d(x·x) = (2·dy)·x: one gradient rather than two summed, and the doubling on
            // dy, which is often a broadcast scalar (a mean's seed), not on a full tensor.
            // Exact: doubling rounds nothing, so this equals dy·x + dy·x.
            if wx {
                let two = b.scalar(b.dtype(dy), 2.0)?;
                let g = b.bin(B::Mul, dy, &two)?;
                let g = b.bin(B::Mul, &g, x)?;
                out[0] = to(b, g, x)?;
            }
        }
        B::Mul => {
            if wx {
                let g = b.bin(B::Mul, dy, y)?;
                out[0] = to(b, g, x)?;
            }
            if wy {
                let g = b.bin(B::Mul, dy, x)?;
                out[1] = to(b, g, y)?;
            }
        }
        B::Div => {
            if wx {
                let g = b.bin(B::Div, dy, y)?;
                out[0] = to(b, g, x)?;
            }
            if wy {
                // d(x/y)/dy = -(x/y)/y
                let q = b.bin(B::Div, &n.outputs[0], y)?;
                let g = b.bin(B::Mul, dy, &q)?;
                let g = b.un(Op::Unary(UnaryOp::Neg), &g)?;
                out[1] = to(b, g, y)?;
            }
        }
        B::Pow => {
            if wx {
                // y * x^(y-1), in x's dtype even when the exponent is an integer.
                let dt = b.dtype(x);
                let yf = if b.dtype(y) == dt {
                    y.to_string()
                } else {
                    b.un(Op::Cast { to: dt }, y)?
                };
                let one = b.scalar(dt, 1.0)?;
                let ym1 = b.bin(B::Sub, &yf, &one)?;
                let p = b.bin(B::Pow, x, &ym1)?;
                let g = b.bin(B::Mul, &p, &yf)?;
                let g = b.bin(B::Mul, dy, &g)?;
                out[0] = to(b, g, x)?;
            }
            if wy {
                // x^y * ln x
                let l = b.un(Op::Unary(UnaryOp::Log), x)?;
                let g = b.bin(B::Mul, &n.outputs[0], &l)?;
                let g = b.bin(B::Mul, dy, &g)?;
                let g = if b.dtype(&g) == b.dtype(y) {
                    g
                } else {
                    b.un(Op::Cast { to: b.dtype(y) }, &g)?
                };
                out[1] = to(b, g, y)?;
            }
        }
        // x mod y = x - y·q (q = floor or trunc of x/y, constant almost everywhere):
        // d/dx = 1, d/dy = -q = -(x - out)/y.
        B::Mod | B::Fmod => {
            if wx {
                out[0] = to(b, dy.to_string(), x)?;
            }
            if wy {
                let r = b.bin(B::Sub, x, &n.outputs[0])?;
                let q = b.bin(B::Div, &r, y)?;
                let g = b.bin(B::Mul, dy, &q)?;
                let g = b.un(Op::Unary(UnaryOp::Neg), &g)?;
                out[1] = to(b, g, y)?;
            }
        }
        // The gradient goes to the operand chosen (x on ties, as the mask says).
        B::Min | B::Max => {
            let cmp = if op == B::Min {
                B::LessOrEqual
            } else {
                B::GreaterOrEqual
            };
            let pick_x = b.bin(cmp, x, y)?;
            let z = b.scalar(b.dtype(dy), 0.0)?;
            if wx {
                let g = b.op1(Op::Where, &[&pick_x, dy, &z], &format!("{x}.d"))?;
                out[0] = to(b, g, x)?;
            }
            if wy {
                let g = b.op1(Op::Where, &[&pick_x, &z, dy], &format!("{y}.d"))?;
                out[1] = to(b, g, y)?;
            }
        }
        // y = x < 0 ? slope·x : x.
        B::PRelu => {
            let z = b.scalar(b.dtype(dy), 0.0)?;
            let neg = b.bin(B::Less, x, &z)?;
            if wx {
                let s = b.bin(B::Mul, dy, y)?;
                let g = b.op1(Op::Where, &[&neg, &s, dy], &format!("{x}.d"))?;
                out[0] = to(b, g, x)?;
            }
            if wy {
                let s = b.bin(B::Mul, dy, x)?;
                let g = b.op1(Op::Where, &[&neg, &s, &z], &format!("{y}.d"))?;
                out[1] = to(b, g, y)?;
            }
        }
        // Comparisons and logic: bool outputs, no gradient.
        B::Equal | B::Less | B::Greater | B::LessOrEqual | B::GreaterOrEqual => {}
        B::And | B::Or | B::Xor => {}
        B::BitwiseAnd | B::BitwiseOr | B::BitwiseXor | B::BitShiftLeft | B::BitShiftRight => {}
    }
    Ok(out)
}

/// Clip passes the gradient where min <= x <= max (PyTorch's clamp); min and max get
/// the gradient of the elements clipped to them.
fn clip(b: &mut Builder, n: &Node, dy: &str) -> Result<Grads> {
    let x = &n.inputs[0];
    let lo = n.inputs.get(1).filter(|s| !s.is_empty()).cloned();
    let hi = n.inputs.get(2).filter(|s| !s.is_empty()).cloned();
    let z = b.scalar(b.dtype(dy), 0.0)?;
    let mut out = vec![None; n.inputs.len()];
    let mut pass = dy.to_string();
    for (k, bound, cmp) in [(1, &lo, B::Less), (2, &hi, B::Greater)] {
        let Some(v) = bound else { continue };
        let out_of = b.bin(cmp, x, v)?;
        if b.needs(v) {
            let g = b.op1(Op::Where, &[&out_of, dy, &z], &format!("{v}.d"))?;
            out[k] = Some(b.sum_to(&g, &b.shape(v))?);
        }
        if b.needs(x) {
            pass = b.op1(Op::Where, &[&out_of, &z, &pass], &format!("{x}.d"))?;
        }
    }
    if b.needs(x) {
        out[0] = Some(pass);
    }
    Ok(out)
}

/// MatMul with numpy semantics: 1-D operands are lifted to matrices, batch dims
/// broadcast; a 2-D weight's gradient is one GEMM over all batch rows.
fn matmul(b: &mut Builder, n: &Node, dy: &str) -> Result<Grads> {
    let (a, w) = (&n.inputs[0], &n.inputs[1]);
    let (sa, sw) = (b.shape(a), b.shape(w));
    let a2s = if sa.len() == 1 {
        vec![1, sa[0]]
    } else {
        sa.clone()
    };
    let w2s = if sw.len() == 1 {
        vec![sw[0], 1]
    } else {
        sw.clone()
    };
    let y2s = crate::graph::infer::matmul_shape(&a2s, &w2s).expect("inferred");
    let a2 = b.reshape(a, &a2s)?;
    let w2 = b.reshape(w, &w2s)?;
    let dy2 = b.reshape(dy, &y2s)?;
    let swap = |r: usize| -> Vec<usize> {
        let mut p: Vec<usize> = (0..r).collect();
        p.swap(r - 1, r - 2);
        p
    };
    let mut out = vec![None, None];
    if b.needs(a) {
        // A 2-D A against batched B (a convolution's weights over its columns): Σ over
        // the batch of dY·Bᵀ. Computing every product and summing them writes the batch
        // times A's size; with the batch moved into the inner dim it is one GEMM, at the
        // cost of transposing dY and B — chosen when that moves less.
        let batched = w2s.len() > 2 && a2s.len() == 2;
        let (m, k, l) = (a2s[0], a2s[1], w2s[w2s.len() - 1]);
        if batched && m * k > (m + k) * l {
            let nb: usize = w2s[..w2s.len() - 2].iter().product();
            let dy3 = b.reshape(&dy2, &[nb, m, l])?;
            let w3 = b.reshape(&w2, &[nb, k, l])?;
            let dyt = b.transpose(&dy3, vec![1, 0, 2])?;
            let wt = b.transpose(&w3, vec![1, 0, 2])?;
            let dyf = b.reshape(&dyt, &[m, nb * l])?;
            let wf = b.reshape(&wt, &[k, nb * l])?;
            let op = Op::Gemm {
                alpha: 1.0,
                beta: 1.0,
                trans_a: false,
                trans_b: true,
            };
            let g = b.op1(op, &[&dyf, &wf], &format!("{a}.d"))?;
            out[0] = Some(b.reshape(&g, &sa)?);
        }
    }
    if b.needs(a) && out[0].is_none() {
        let g = if w2s.len() == 2 {
            let op = Op::FusedMatMul {
                activation: crate::graph::Activation::None,
                trans_b: true,
            };
            b.op1(op, &[&dy2, &w2], &format!("{a}.d"))?
        } else {
            let wt = b.transpose(&w2, swap(w2s.len()))?;
            b.op1(Op::MatMul, &[&dy2, &wt], &format!("{a}.d"))?
        };
        let g = b.sum_to(&g, &a2s)?;
        out[0] = Some(b.reshape(&g, &sa)?);
    }
    if b.needs(w) {
        let g = if w2s.len() == 2 {
            // Every batch row contributes to the one weight: flatten and use one GEMM.
            let k = a2s[a2s.len() - 1];
            let nn = w2s[1];
            let rows: usize = a2s[..a2s.len() - 1].iter().product();
            let af = b.reshape(&a2, &[rows, k])?;
            let df = b.reshape(&dy2, &[rows, nn])?;
            let op = Op::Gemm {
                alpha: 1.0,
                beta: 1.0,
                trans_a: true,
                trans_b: false,
            };
            b.op1(op, &[&af, &df], &format!("{w}.d"))?
        } else {
            let at = b.transpose(&a2, swap(a2s.len()))?;
            let g = b.op1(Op::MatMul, &[&at, &dy2], &format!("{w}.d"))?;
            b.sum_to(&g, &w2s)?
        };
        out[1] = Some(b.reshape(&g, &sw)?);
    }
    Ok(out)
}

/// Y = alpha·op(A)·op(B) + beta·C.
fn gemm(
    b: &mut Builder,
    n: &Node,
    dy: &str,
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
) -> Result<Grads> {
    let (a, w) = (&n.inputs[0], &n.inputs[1]);
    let g = |ta: bool, tb: bool| Op::Gemm {
        alpha,
        beta: 1.0,
        trans_a: ta,
        trans_b: tb,
    };
    let mut out = vec![None; n.inputs.len()];
    if b.needs(a) {
        out[0] = Some(if trans_a {
            b.op1(g(trans_b, true), &[w, dy], &format!("{a}.d"))?
        } else {
            b.op1(g(false, !trans_b), &[dy, w], &format!("{a}.d"))?
        });
    }
    if b.needs(w) {
        out[1] = Some(if trans_b {
            b.op1(g(true, trans_a), &[dy, a], &format!("{w}.d"))?
        } else {
            b.op1(g(!trans_a, false), &[a, dy], &format!("{w}.d"))?
        });
    }
    if let Some(c) = n.inputs.get(2).filter(|c| b.needs(c)) {
        let mut d = dy.to_string();
        if beta != 1.0 {
            let s = b.scalar(b.dtype(dy), beta as f64)?;
            d = b.bin(B::Mul, &d, &s)?;
        }
        out[2] = Some(b.sum_to(&d, &b.shape(c))?);
    }
    Ok(out)
}

fn reduce(
    b: &mut Builder,
    n: &Node,
    dy: &str,
    kind: ReduceKind,
    axes: Option<Vec<i64>>,
    noop_with_empty_axes: bool,
) -> Result<Grads> {
    let x = &n.inputs[0];
    let sx = b.shape(x);
    let r = sx.len();
    let axes = match axes {
        Some(a) => a,
        None => match n.inputs.get(1).filter(|s| !s.is_empty()) {
            None => vec![],
            Some(v) => b.konst(v).map(|t| t.to_i64_vec()).unwrap_or_default(),
        },
    };
    let mut out = vec![None; n.inputs.len()];
    if axes.is_empty() && noop_with_empty_axes {
        out[0] = Some(dy.to_string());
        return Ok(out);
    }
    let axes: Vec<usize> = if axes.is_empty() {
        (0..r).collect()
    } else {
        axes.iter()
            .filter_map(|&a| crate::graph::infer::norm_axis(a, r))
            .collect()
    };
    let mut kd = sx.clone();
    for &a in &axes {
        kd[a] = 1;
    }
    let count: usize = axes.iter().map(|&a| sx[a]).product();
    let dyk = b.reshape(dy, &kd)?;
    let xs = b.shape_const(&sx)?;
    let g = match kind {
        ReduceKind::Sum => b.op1(Op::Expand, &[&dyk, &xs], &format!("{x}.d"))?,
        ReduceKind::Mean => {
            let s = b.scalar(b.dtype(dy), 1.0 / count.max(1) as f64)?;
            let d = b.bin(B::Mul, &dyk, &s)?;
            b.op1(Op::Expand, &[&d, &xs], &format!("{x}.d"))?
        }
        ReduceKind::MeanSquare => {
            // d mean(x²) = x · (2/N)·dY: one pass over x, dY broadcast.
            let s = b.scalar(b.dtype(dy), 2.0 / count.max(1) as f64)?;
            let d = b.bin(B::Mul, &dyk, &s)?;
            b.op1(Op::Binary(B::Mul), &[x, &d], &format!("{x}.d"))?
        }
        ReduceKind::Prod => reduce_prod(b, x, &dyk, &axes)?,
        ReduceKind::Max => {
            // Ties share the gradient equally (PyTorch's amax).
            let yk = b.reshape(&n.outputs[0], &kd)?;
            let hit = b.bin(B::Equal, x, &yk)?;
            let dt = b.dtype(dy);
            let m = b.un(Op::Cast { to: dt }, &hit)?;
            let cnt = b.un(
                Op::Reduce {
                    kind: ReduceKind::Sum,
                    axes: Some(axes.iter().map(|&a| a as i64).collect()),
                    keepdims: true,
                    noop_with_empty_axes: false,
                },
                &m,
            )?;
            let share = b.bin(B::Div, &dyk, &cnt)?;
            b.op1(Op::Binary(B::Mul), &[&m, &share], &format!("{x}.d"))?
        }
    };
    out[0] = Some(g);
    Ok(out)
}

/// ReduceProd's dX = dY · (the product of the other elements of X's group), exact where X
/// holds zeros: a group without zeros gives Y / X (with the product of the non-zero
/// elements for Y); one zero gets that product and the rest of its group 0; a group with
/// two or more zeros is 0 throughout. `dyk` is dY with the reduced dims kept.
fn reduce_prod(b: &mut Builder, x: &str, dyk: &str, axes: &[usize]) -> Result<String> {
    let dt = b.dtype(x);
    let (z, one) = (b.scalar(dt, 0.0)?, b.scalar(dt, 1.0)?);
    let kept = |kind| Op::Reduce {
        kind,
        axes: Some(axes.iter().map(|&a| a as i64).collect()),
        keepdims: true,
        noop_with_empty_axes: false,
    };
    let h = format!("{x}.d");
    let is0 = b.bin(B::Equal, x, &z)?;
    let nonzero = b.op1(Op::Where, &[&is0, &one, x], &h)?;
    let p = b.un(kept(ReduceKind::Prod), &nonzero)?;
    let zeros = b.un(Op::Cast { to: dt }, &is0)?;
    let count = b.un(kept(ReduceKind::Sum), &zeros)?;
    let g = b.bin(B::Mul, dyk, &p)?;
    let none = b.bin(B::Div, &g, x)?;
    let at_zero = b.op1(Op::Where, &[&is0, &g, &z], &h)?;
    let (c0, c1) = (b.bin(B::Equal, &count, &z)?, b.bin(B::Equal, &count, &one)?);
    let single = b.op1(Op::Where, &[&c1, &at_zero, &z], &h)?;
    b.op1(Op::Where, &[&c0, &none, &single], &h)
}

/// CumProd's dX: dx_k = Σ over the outputs i that read x_k of dy_i · Π_{j in i's product,
/// j ≠ k} x_j, exact where a line holds zeros. Before the line's first zero (in scan
/// order) x_k is not 0 and that is (Σ dy_i·y_i) / x_k, the sum a CumSum running the other
/// way; at the first zero it is the same sum over the scan that takes that zero as 1; after
/// it every such product holds the zero: 0.
fn cumprod(b: &mut Builder, n: &Node, dy: &str, exclusive: bool, reverse: bool) -> Result<String> {
    let (x, axis, y) = (&n.inputs[0], &n.inputs[1], &n.outputs[0]);
    let dt = b.dtype(x);
    let h = format!("{x}.d");
    let (z, one) = (b.scalar(dt, 0.0)?, b.scalar(dt, 1.0)?);
    let scan = |prod, exclusive, reverse| Op::Cumulative {
        prod,
        exclusive,
        reverse,
    };
    let is0 = b.bin(B::Equal, x, &z)?;
    let zeros = b.un(Op::Cast { to: dt }, &is0)?;
    // Zeros at or before each position, in scan order.
    let seen = b.op1(scan(false, false, reverse), &[&zeros, axis], &h)?;
    let before = b.bin(B::Equal, &seen, &z)?;
    let once = b.bin(B::Equal, &seen, &one)?;
    let first = b.bin(B::And, &is0, &once)?;
    let back = scan(false, exclusive, !reverse);
    let dyy = b.bin(B::Mul, dy, y)?;
    let s = b.op1(back.clone(), &[&dyy, axis], &h)?;
    let plain = b.bin(B::Div, &s, x)?;
    let x1 = b.op1(Op::Where, &[&first, &one, x], &h)?;
    let y1 = b.op1(scan(true, exclusive, reverse), &[&x1, axis], &h)?;
    let dyy1 = b.bin(B::Mul, dy, &y1)?;
    let s1 = b.op1(back, &[&dyy1, axis], &h)?;
    let at_first = b.op1(Op::Where, &[&first, &s1, &z], &h)?;
    b.op1(Op::Where, &[&before, &plain, &at_first], &h)
}
