//! No-op removal: nodes that return their input unchanged (Identity, Dropout at
//! inference, Cast to the same dtype, Reshape to the same shape, identity Transpose) are
//! bypassed, two consecutive Transposes become one, and an Expand that a binary op's own
//! broadcast makes redundant is skipped. A node producing a graph output
//! is kept: removing it would rename the output.

use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::Op;

pub(crate) fn rules(training: bool) -> Vec<Rule> {
    vec![
        Rule {
            name: "identity",
            anchor: |op| matches!(op, Op::Identity),
            run: identity,
        },
        if training {
            Rule {
                name: "dropout",
                anchor: |op| matches!(op, Op::Dropout { .. }),
                run: dropout_training,
            }
        } else {
            Rule {
                name: "dropout",
                anchor: |op| matches!(op, Op::Dropout { .. }),
                run: dropout_inference,
            }
        },
        Rule {
            name: "cast_same_dtype",
            anchor: |op| matches!(op, Op::Cast { .. }),
            run: cast_same,
        },
        Rule {
            name: "reshape_same_shape",
            anchor: |op| matches!(op, Op::Reshape { .. }),
            run: reshape_same,
        },
        Rule {
            name: "transpose_identity",
            anchor: |op| matches!(op, Op::Transpose { .. }),
            run: transpose_identity,
        },
        Rule {
            name: "transpose_pair",
            anchor: |op| matches!(op, Op::Transpose { .. }),
            run: transpose_pair,
        },
        Rule {
            name: "expand_broadcast",
            anchor: |op| matches!(op, Op::Binary(_)),
            run: expand_broadcast,
        },
    ]
}

/// An Expand feeding a broadcasting binary op materializes what the op would broadcast
/// anyway (a mean's gradient, a scalar seed spread over a tensor). Where the op's output
/// shape is the same from the unexpanded input, the op reads that input instead; where
/// the other input broadcasts into the unexpanded one (a scalar factor), the op runs on
/// the small tensor and the Expand moves after it, to be dropped by a later op. The
/// results are the same elements: only the copies go.
fn expand_broadcast(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    use crate::graph::infer::broadcast;
    let n = cx.node(i);
    let out = cx.facts.static_shape(&n.outputs[0])?;
    for side in 0..2 {
        let v = n.inputs.get(side)?;
        let Some((_, e)) = cx.prod(v, |op| matches!(op, Op::Expand)) else {
            continue;
        };
        let small = &e.inputs[0];
        let other = &n.inputs[1 - side];
        let (ss, so) = (cx.facts.static_shape(small)?, cx.facts.static_shape(other)?);
        let b = broadcast(&ss, &so)?;
        let mut op_node = n.clone();
        op_node.inputs[side] = small.clone();
        if b == out {
            return Some(Patch {
                remove: vec![i],
                add: vec![op_node],
                ..Default::default()
            });
        }
        if b == ss && cx.sole_consumer(v) == Some(i) {
            let t = cx.fresh_value(&format!("{}_small", n.outputs[0]));
            op_node.outputs = vec![t.clone()];
            let mut expand = e.clone();
            expand.name = cx.fresh_node(&format!("{}_expand", n.name));
            expand.inputs[0] = t;
            expand.outputs = n.outputs.clone();
            return Some(Patch {
                remove: vec![i],
                add: vec![op_node, expand],
                ..Default::default()
            });
        }
    }
    None
}

/// Bypasses node `i`: its first output's readers read its first input instead.
fn bypass(cx: &Ctx, i: usize) -> Option<Patch> {
    let n = cx.node(i);
    let (out, inp) = (&n.outputs[0], n.input(0)?);
    if cx.needed(out) {
        return None;
    }
    Some(Patch {
        remove: vec![i],
        rewire: vec![(out.clone(), inp.to_string())],
        ..Default::default()
    })
}

fn identity(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    bypass(cx, i)
}

/// Dropout is the identity unless training (or its `training_mode` input says so), and
/// its mask output must be unused.
fn dropout_inference(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let mask_unused = n
        .outputs
        .get(1)
        .is_none_or(|m| m.is_empty() || (cx.consumers(m).is_empty() && !cx.needed(m)));
    let train_off = n.input(2).is_none_or(|t| cx.scalar(t) == Some(0.0));
    (mask_unused && train_off).then(|| bypass(cx, i)).flatten()
}

/// While training only a Dropout of ratio 0 is a no-op.
fn dropout_training(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::Dropout { ratio, .. } = n.op else {
        return None;
    };
    let ratio = match n.input(1) {
        Some(r) => cx.scalar(r)?,
        None => ratio as f64,
    };
    if ratio != 0.0 {
        return None;
    }
    let mask_unused = n
        .outputs
        .get(1)
        .is_none_or(|m| m.is_empty() || (cx.consumers(m).is_empty() && !cx.needed(m)));
    mask_unused.then(|| bypass(cx, i)).flatten()
}

fn cast_same(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::Cast { to } = n.op else { return None };
    let x = &n.inputs[0];
    let from = cx
        .facts
        .dtype(x)
        .or_else(|| cx.konst(x).map(|t| t.dtype()))
        .or_else(|| cx.g.input(x).map(|i| i.dtype))?;
    (from == to).then(|| bypass(cx, i)).flatten()
}

fn reshape_same(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    cx.facts
        .same_shape(&n.inputs[0], &n.outputs[0])
        .then(|| bypass(cx, i))
        .flatten()
}

/// The explicit permutation of a Transpose (the default reverses the axes).
fn perm_of(cx: &Ctx, op: &Op, x: &str) -> Option<Vec<usize>> {
    match op {
        Op::Transpose { perm: Some(p) } => Some(p.clone()),
        Op::Transpose { perm: None } => Some((0..cx.facts.rank(x)?).rev().collect()),
        _ => None,
    }
}

fn is_identity(p: &[usize]) -> bool {
    p.iter().enumerate().all(|(i, &v)| i == v)
}

fn transpose_identity(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let p = perm_of(cx, &n.op, &n.inputs[0])?;
    is_identity(&p).then(|| bypass(cx, i)).flatten()
}

/// Transpose(Transpose(x, p1), p2) = Transpose(x, q) with q[i] = p1[p2[i]].
fn transpose_pair(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let (_, first) = cx.prod(&n.inputs[0], |op| matches!(op, Op::Transpose { .. }))?;
    let x = &first.inputs[0];
    let p1 = perm_of(cx, &first.op, x)?;
    let p2 = perm_of(cx, &n.op, &n.inputs[0])?;
    if p1.len() != p2.len() {
        return None;
    }
    let q: Vec<usize> = p2.iter().map(|&j| p1[j]).collect();
    if is_identity(&q) && !cx.needed(&n.outputs[0]) {
        return Some(Patch {
            remove: vec![i],
            rewire: vec![(n.outputs[0].clone(), x.clone())],
            ..Default::default()
        });
    }
    let mut merged = n.clone();
    merged.op = Op::Transpose { perm: Some(q) };
    merged.inputs = vec![x.clone()];
    Some(Patch {
        remove: vec![i],
        add: vec![merged],
        ..Default::default()
    })
}
