//! Convolution fusion: a per-channel affine map after a Conv with constant weights —
//! the inference form of BatchNormalization as the importer writes it, `(y - mean) /
//! sqrt(var + eps) · scale + B`, or any chain of Add/Sub/Mul/Div by per-channel
//! constants — folds into the Conv's weights and bias (one pass over the output
//! instead of one per step).

use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::infer::ValueType;
use crate::graph::{BinaryOp, InitSource, Initializer, Node, Op};
use crate::tensor::Tensor;

/// The affine fold first: a normalization folded away may leave a residual Add or an
/// activation right after the Conv for `conv_epilogue`.
pub(crate) const RULES: &[Rule] = &[
    Rule {
        name: "conv_affine",
        // A channels-last Conv's per-channel operands lie along its last axis.
        anchor: |op| matches!(op, Op::Conv { window, .. } if !window.channels_last),
        run: conv_affine,
    },
    super::conv_epilogue::RULE,
];

/// Why the rule did not fire on a convolution with nothing to fold after it (the usual
/// case, which `--explain-fusion` leaves out).
pub(crate) const NOTHING_FOLLOWS: &str =
    "no per-channel affine step of the convolution's shape follows it";

/// The per-channel values of constant `c` against a value of shapes `vs` whose channel
/// axis (1) has `m` entries: `c` must broadcast to it and vary along that axis only.
fn per_channel(c: &Tensor, vs: &[&[usize]], m: usize) -> Option<Vec<f64>> {
    let cs = c.shape();
    let fits = vs.iter().all(|v| {
        cs.len() <= v.len()
            && cs.iter().rev().enumerate().all(|(k, &d)| {
                let axis = v.len() - 1 - k;
                d == 1 || (axis == 1 && d == v[1])
            })
    });
    if !fits {
        return None;
    }
    let vals = c.to_f64_vec();
    Some(match vals.len() {
        1 => vec![vals[0]; m],
        n if n == m => vals,
        _ => return None,
    })
}

/// The value of `v` when it is a constant, or computed from constants alone by a few
/// small elementwise and reshaping nodes (not from trainable values): BatchNormalization's
/// `sqrt(var + eps)` and unsqueezed statistics.
fn static_value(cx: &Ctx, v: &str, depth: usize) -> Option<Tensor> {
    if let Some(t) = cx.konst(v) {
        return (!cx.trainable(v)).then(|| t.clone());
    }
    let (_, p) = cx.prod(v, |op| {
        matches!(
            op,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::Unsqueeze { .. }
                | Op::Squeeze { .. }
                | Op::Reshape { .. }
                | Op::Cast { .. }
                | Op::CastLike
                | Op::Identity
        )
    })?;
    if depth == 0 || cx.facts.static_shape(v)?.iter().product::<usize>() > 1 << 16 {
        return None;
    }
    let args = p
        .inputs
        .iter()
        .map(|i| match i.is_empty() {
            true => Some(None),
            false => static_value(cx, i, depth - 1).map(Some),
        })
        .collect::<Option<Vec<Option<Tensor>>>>()?;
    let outs = p
        .outputs
        .iter()
        .map(|o| {
            Some(ValueType::new(
                cx.facts.dtype(o)?,
                &cx.facts.static_shape(o)?,
            ))
        })
        .collect::<Option<Vec<_>>>()?;
    let refs: Vec<Option<&Tensor>> = args.iter().map(Option::as_ref).collect();
    let mut r = cx.facts.eval.eval(p, &refs, &outs).ok()?;
    let k = p.outputs.iter().position(|o| o == v)?;
    Some(r.swap_remove(k))
}

/// `Conv(X, W, B)` → a chain of Add/Sub/Mul/Div by per-channel constants, through
/// Reshapes that keep the batch and channel axes → `Conv(X, W·s, B·s + t)` producing
/// the chain's last value of Y's shape. W and B must be constants that are not trained
/// (a gradient or a training step would otherwise reach the folded copy; `freeze` makes
/// every weight such a constant for a graph that only runs forward), as must the chain's
/// operands;
/// every value of the chain must be read only by the next step (Y may also be read by
/// Shape nodes, which then read the fused output: it has Y's shape).
fn conv_affine(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let fixed = |v: &str| cx.konst(v).filter(|_| !cx.trainable(v));
    let n = cx.node(i);
    let (x, w) = (&n.inputs[0], &n.inputs[1]);
    let bias = n.inputs.get(2).filter(|b| !b.is_empty());
    let Some(wt) = fixed(w) else {
        return why.no(match cx.konst(w) {
            Some(_) => "the weights are trainable (a forward-only `run` or `bench` folds them)",
            None => "the weights are not a constant",
        });
    };
    let bt = match bias {
        Some(b) => match fixed(b) {
            Some(t) => Some(t),
            None => return why.no("the bias is not an untrained constant"),
        },
        None => None,
    };
    let m = *wt.shape().first()?;
    let y = n.outputs[0].as_str();
    let y_shapes = cx.facts.shapes(y)?;
    // Y may be read by Shape nodes besides the chain.
    let readers: Vec<usize> = cx.consumers(y).to_vec();
    let mut chain_start = None;
    for &r in &readers {
        match cx.node(r).op {
            Op::Shape { .. } => {}
            _ if chain_start.is_none() => chain_start = Some(r),
            _ => return why.no("the convolution's output is read by more than the chain"),
        }
    }
    if cx.needed(y) {
        return why.no("the convolution's output is a graph output");
    }
    let (mut s, mut t) = (vec![1.0; m], vec![0.0; m]);
    let mut v = y;
    let mut next = chain_start;
    let mut taken: Vec<usize> = vec![];
    // The longest prefix of the chain that ends on a value of Y's shape.
    let mut best: Option<(usize, Vec<f64>, Vec<f64>, &str)> = None;
    while let Some(j) = next {
        let step = cx.node(j);
        let shapes = cx.facts.shapes(&step.outputs[0])?;
        match step.op {
            Op::Reshape { .. } if step.inputs[0] == v => {
                let vs = cx.facts.shapes(v)?;
                let keeps = vs
                    .iter()
                    .zip(&shapes)
                    .all(|(a, b)| a.len() >= 2 && b.len() >= 2 && a[..2] == b[..2]);
                if !keeps {
                    break;
                }
            }
            Op::Binary(op @ (BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div)) => {
                let Some(other) = cx.other(step, v) else {
                    break;
                };
                let vs = cx.facts.shapes(v)?;
                let Some(c) = static_value(cx, other, 8).and_then(|c| per_channel(&c, &vs, m))
                else {
                    break;
                };
                let v_first = step.inputs[0] == v;
                if op == BinaryOp::Div && !v_first {
                    break; // c / v is not affine in v
                }
                for k in 0..m {
                    match (op, v_first) {
                        (BinaryOp::Add, _) => t[k] += c[k],
                        (BinaryOp::Sub, true) => t[k] -= c[k],
                        (BinaryOp::Sub, false) => {
                            s[k] = -s[k];
                            t[k] = c[k] - t[k];
                        }
                        (BinaryOp::Mul, _) => {
                            s[k] *= c[k];
                            t[k] *= c[k];
                        }
                        _ => {
                            // Div, with v the numerator (checked above).
                            s[k] /= c[k];
                            t[k] /= c[k];
                        }
                    }
                }
            }
            _ => break,
        }
        taken.push(j);
        v = &step.outputs[0];
        let affine = taken
            .iter()
            .any(|&k| matches!(cx.node(k).op, Op::Binary(_)));
        if affine && shapes == y_shapes {
            best = Some((taken.len(), s.clone(), t.clone(), v));
        }
        next = cx.sole_consumer(v);
    }
    let Some((len, s, t, out)) = best else {
        return why.no(NOTHING_FOLLOWS);
    };
    if s.iter().chain(&t).any(|v| !v.is_finite()) {
        return why.no("the folded scale or shift is not finite");
    }
    // W' = W · s (per output channel), B' = B · s + t, in W's dtype.
    let per = wt.numel() / m.max(1);
    let wv: Vec<f64> = wt
        .to_f64_vec()
        .iter()
        .enumerate()
        .map(|(k, &x)| x * s[k / per.max(1)])
        .collect();
    let b0 = bt.map_or(vec![0.0; m], |b| b.to_f64_vec());
    let bv: Vec<f64> = (0..m).map(|k| b0[k] * s[k] + t[k]).collect();
    let dt = wt.dtype();
    let (wn, bn) = (
        cx.fresh_value(&format!("{w}/folded")),
        cx.fresh_value(&format!("{}/folded_bias", n.name)),
    );
    let inits = vec![
        Initializer {
            name: wn.clone(),
            tensor: Tensor::from_f64(dt, wt.shape(), &wv).ok()?,
            trainable: false,
            source: InitSource::Data,
            loc: n.loc.clone(),
        },
        Initializer {
            name: bn.clone(),
            tensor: Tensor::from_f64(dt, &[m], &bv).ok()?,
            trainable: false,
            source: InitSource::Data,
            loc: n.loc.clone(),
        },
    ];
    let fused = Node {
        name: n.name.clone(),
        op: n.op.clone(),
        inputs: vec![x.clone(), wn, bn],
        outputs: vec![out.to_string()],
        loc: n.loc.clone(),
    };
    if let Err(e) = cx
        .facts
        .check_with(std::slice::from_ref(&fused), &inits, out)
    {
        return why.no(e);
    }
    let mut remove = vec![i];
    remove.extend(&taken[..len]);
    Some(Patch {
        remove,
        add: vec![fused],
        inits,
        rewire: vec![(y.to_string(), out.to_string())],
        note: None,
    })
}
