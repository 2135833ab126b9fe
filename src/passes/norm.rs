//! Normalization fusion: the RMS normalization exporters spell out as elementwise ops,
//! `x / sqrt(mean(x²) + eps) · scale`, becomes one `RMSNormalization` node (one pass over
//! each row instead of six, and one fused gradient). Later in the pipeline (after the
//! MatMul epilogues, which take a residual Add for free), an `Add` left feeding a
//! normalization joins it (`RESIDUAL_RULES`).

use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::{BinaryOp, InitSource, Initializer, Node, Op, ReduceKind, UnaryOp};
use crate::tensor::Tensor;

pub(crate) const RULES: &[Rule] = &[Rule {
    name: "rms_norm",
    anchor: |op| {
        matches!(
            op,
            Op::Reduce {
                kind: ReduceKind::Mean | ReduceKind::MeanSquare,
                keepdims: true,
                noop_with_empty_axes: false,
                ..
            }
        )
    },
    run: rms_norm,
}];

/// Run by the `residual_norm_fusion` pass.
pub(crate) const RESIDUAL_RULES: &[Rule] = &[Rule {
    name: "residual_norm",
    anchor: |op| {
        matches!(
            op,
            Op::LayerNormalization {
                residual: false,
                ..
            }
        )
    },
    run: residual_norm,
}];

/// `S = Add(X, R)` → `LayerNormalization(S)` (or RMSNormalization) with X and R of S's
/// shape and type becomes one `AddLayerNormalization` (`AddRMSNormalization`) computing
/// S and normalizing it as it is written: the pre-norm residual stream (S read on by the
/// next residual Add) or the post-norm block's sum (S read by nothing else). S stays an
/// output under its name. Not when the Add broadcasts (a bias), nor when Scale or B are
/// computed from S.
fn residual_norm(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::LayerNormalization {
        axis, epsilon, rms, ..
    } = n.op
    else {
        return None;
    };
    let s = &n.inputs[0];
    let Some((j, add)) = cx.prod(s, |op| *op == Op::Binary(BinaryOp::Add)) else {
        return why.no("X is not an Add's sum");
    };
    let (x, r) = (&add.inputs[0], &add.inputs[1]);
    let dt = cx.facts.dtype(s);
    if [x, r]
        .iter()
        .any(|v| !cx.facts.same_shape(v, s) || cx.facts.dtype(v) != dt)
    {
        return why.no("the Add broadcasts");
    }
    let params = &n.inputs[1..];
    if params.iter().any(|p| depends_on(cx, p, j)) {
        return why.no("Scale or B is computed from the sum");
    }
    use crate::graph::op::{norm_residual_input, norm_sum_output};
    let mut inputs = n.inputs.clone();
    inputs[0] = x.clone();
    inputs.resize(norm_residual_input(rms), String::new());
    inputs.push(r.clone());
    let mut outputs = n.outputs.clone();
    outputs.resize(norm_sum_output(rms), String::new());
    outputs.push(s.clone());
    let fused = Node {
        name: n.name.clone(),
        op: Op::LayerNormalization {
            axis,
            epsilon,
            rms,
            residual: true,
        },
        inputs,
        outputs,
        loc: n.loc.clone(),
    };
    Some(Patch {
        remove: vec![j, i],
        add: vec![fused],
        ..Default::default()
    })
}

/// Whether value `v` is computed from node `j`'s outputs. Only nodes after `j` in the
/// execution order can be, so the walk back from `v` stops at them.
fn depends_on(cx: &Ctx, v: &str, j: usize) -> bool {
    let mut stack = vec![v];
    let mut seen = std::collections::HashSet::new();
    while let Some(v) = stack.pop() {
        let Some(p) = cx.producer(v) else {
            continue;
        };
        if p == j {
            return true;
        }
        if cx.pos[p] > cx.pos[j] && seen.insert(p) {
            stack.extend(cx.node(p).inputs.iter().map(|s| s.as_str()));
        }
    }
    false
}

/// `ReduceMean(x², trailing axes)` (the square a `Pow(x, 2)` or `x·x`, or the mean a
/// `ReduceMeanSquare`) → `Add(eps)` → `Sqrt` → `x / root`, `x · Reciprocal(root)` or
/// `x · (1 / root)` → optionally a `Cast` back to the type of the `Cast` that widened x
/// (the f16/bf16 form) → optionally `· scale` (broadcasting to the normalized axes).
/// Every intermediate must be read only by the next step, eps must be a constant, and a
/// missing scale becomes ones.
fn rms_norm(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::Reduce { kind, axes, .. } = &n.op else {
        return None;
    };
    let mut remove = vec![i];
    // The rows' values x, and the squares' node when it is a separate one.
    let x = match kind {
        ReduceKind::MeanSquare => n.inputs[0].as_str(),
        _ => {
            let (j, sq) = cx.prod(&n.inputs[0], |op| {
                matches!(op, Op::Binary(BinaryOp::Mul | BinaryOp::Pow))
            })?;
            let square = match sq.op {
                Op::Binary(BinaryOp::Mul) => sq.inputs[0] == sq.inputs[1],
                _ => cx.scalar(&sq.inputs[1]) == Some(2.0),
            };
            if !square {
                return why.no("the mean is not of a square");
            }
            if cx.sole_consumer(&sq.outputs[0]) != Some(i) {
                return why.no("the squares are read elsewhere");
            }
            remove.push(j);
            sq.inputs[0].as_str()
        }
    };
    let Some(dt) = cx.facts.dtype(x).filter(|d| d.is_float()) else {
        return why.no("x is not floating");
    };
    let rank = cx.facts.rank(x)?;
    let axes = match (axes, n.inputs.get(1).filter(|v| !v.is_empty())) {
        (Some(a), _) => a.clone(),
        (None, Some(v)) => match cx.konst(v) {
            Some(t) => t.to_i64_vec(),
            None => return why.no("the axes are not a constant"),
        },
        (None, None) => (0..rank as i64).collect(),
    };
    let mut axes: Vec<usize> = axes
        .iter()
        .map(|&a| if a < 0 { a + rank as i64 } else { a } as usize)
        .collect();
    axes.sort_unstable();
    let first = rank.checked_sub(axes.len())?;
    if axes.is_empty() || axes != (first..rank).collect::<Vec<_>>() {
        return why.no("the mean is not over the trailing axes");
    }
    // Each next step: the one node reading `v`, when it satisfies `is`.
    let next = |v: &str, is: &dyn Fn(&Node) -> bool| -> Option<(usize, &Node)> {
        let j = cx.sole_consumer(v)?;
        is(cx.node(j)).then(|| (j, cx.node(j)))
    };
    let ms = &n.outputs[0];
    let Some((j, add)) = next(ms, &|m| m.op == Op::Binary(BinaryOp::Add)) else {
        return why.no("the mean square is not only read by an Add");
    };
    let Some(eps) = cx.other(add, ms).and_then(|e| cx.scalar(e)) else {
        return why.no("epsilon is not a scalar constant");
    };
    if !(eps >= 0.0 && eps.is_finite()) {
        return why.no("epsilon is negative or not finite");
    }
    remove.push(j);
    let Some((j, root)) = next(&add.outputs[0], &|m| m.op == Op::Unary(UnaryOp::Sqrt)) else {
        return why.no("the variance is not only read by a Sqrt");
    };
    remove.push(j);
    let root = root.outputs[0].as_str();
    // x / root, or x times the reciprocal (Reciprocal, or 1 / root).
    let Some(j) = cx.sole_consumer(root) else {
        return why.no("the root is read elsewhere");
    };
    let step = cx.node(j);
    remove.push(j);
    let div = step.op == Op::Binary(BinaryOp::Div);
    let normalized = if div && step.inputs == [x, root] {
        step
    } else if step.op == Op::Unary(UnaryOp::Reciprocal)
        || (div && step.inputs[1] == root && cx.scalar(&step.inputs[0]) == Some(1.0))
    {
        let inv = &step.outputs[0];
        let Some((k, m)) = next(inv, &|m| m.op == Op::Binary(BinaryOp::Mul)) else {
            return why.no("the reciprocal root is not only read by a Mul");
        };
        if cx.other(m, inv) != Some(x) {
            return why.no("the reciprocal root does not multiply x");
        }
        remove.push(k);
        m
    } else {
        return why.no("the root does not divide x");
    };
    let mut y = normalized.outputs[0].as_str();
    // The f16/bf16 form: x widened by a Cast, the result cast back.
    let mut input = x;
    if let Some((_, c)) = cx.prod(x, |op| matches!(op, Op::Cast { .. })) {
        let narrow = cx.facts.dtype(&c.inputs[0]);
        let back = next(y, &|m| match m.op {
            Op::Cast { to } => Some(to) == narrow,
            Op::CastLike => cx.facts.dtype(&m.inputs[1]) == narrow,
            _ => false,
        });
        if let (Some(nd), Some((k, b))) = (narrow, back) {
            if nd.is_float() && nd.size() < dt.size() {
                remove.push(k);
                y = &b.outputs[0];
                input = &c.inputs[0];
            }
        }
    }
    let in_dt = cx.facts.dtype(input)?;
    let xs = cx.facts.shapes(input)?;
    // · scale, when the scale broadcasts to the normalized axes and not beyond.
    let scaled = next(y, &|m| m.op == Op::Binary(BinaryOp::Mul)).and_then(|(k, m)| {
        let s = cx.other(m, y)?;
        let fits = cx.facts.dtype(s) == Some(in_dt)
            && cx.facts.shapes(s)?.iter().zip(&xs).all(|(s, x)| {
                s.len() <= x.len() - first
                    && s.iter()
                        .rev()
                        .zip(x.iter().rev())
                        .all(|(a, b)| a == b || *a == 1)
            });
        fits.then_some((k, m, s))
    });
    let mut inits = vec![];
    let (scale, out) = match scaled {
        Some((k, m, s)) => {
            remove.push(k);
            (s.to_string(), m.outputs[0].clone())
        }
        None => {
            // No scale: ones over the normalized axes, which must be of fixed size.
            let Some(norm) = cx.facts.static_shape(input).map(|s| s[first..].to_vec()) else {
                return why.no("no scale, and the normalized axes have no fixed size");
            };
            let name = cx.fresh_value(&format!("{}/unit_scale", n.name));
            let ones = Tensor::from_f64(in_dt, &norm, &vec![1.0; norm.iter().product()]).ok()?;
            inits.push(Initializer {
                name: name.clone(),
                tensor: ones,
                trainable: false,
                source: InitSource::Data,
                loc: n.loc.clone(),
            });
            (name, y.to_string())
        }
    };
    let fused = Node {
        name: n.name.clone(),
        op: Op::LayerNormalization {
            axis: first as i64,
            epsilon: eps as f32,
            rms: true,
            residual: false,
        },
        inputs: vec![input.to_string(), scale],
        outputs: vec![out.clone()],
        loc: n.loc.clone(),
    };
    if let Err(e) = cx
        .facts
        .check_with(std::slice::from_ref(&fused), &inits, &out)
    {
        return why.no(e);
    }
    Some(Patch {
        remove,
        add: vec![fused],
        inits,
        ..Default::default()
    })
}
