//! Gated-MLP fusion (SwiGLU, GeGLU, GLU): `act(x·Wg + bg) * (x·Wu + bu)`, the gated
//! linear unit of LLaMA-, Mistral-, Qwen- and Gemma-style MLPs, becomes one
//! `GatedMatMul`: both products of one x and their gate in one node, and one fused
//! gradient (dG and dU in one pass) where the unfused form takes a Mul's two gradients
//! and the activation's. Part of the MatMul-epilogue pass: it runs once the gate's
//! activation (and any bias) has gone into a FusedMatMul.

use super::pattern::{Ctx, Patch, Why};
use crate::graph::{Activation, BinaryOp, Node, Op};

/// `Mul(p, q)` where one operand is a FusedMatMul with an activation and the other a
/// MatMul, or a FusedMatMul with no activation, of the same A with weights of the same
/// shape and layout; neither has a residual, and each is read only by the Mul.
pub(super) fn gated_matmul(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    if n.op != Op::Binary(BinaryOp::Mul) || n.inputs[0] == n.inputs[1] {
        return None;
    }
    // (node index, node, activation, trans_b) of a product read only by this Mul.
    let product = |v: &str| {
        let (j, p) = cx.prod(v, |op| matches!(op, Op::MatMul | Op::FusedMatMul { .. }))?;
        let (act, trans_b) = match p.op {
            Op::MatMul => (Activation::None, false),
            Op::FusedMatMul {
                activation,
                trans_b,
            } => (activation, trans_b),
            _ => return None,
        };
        Some((j, p, act, trans_b))
    };
    let (Some(a), Some(b)) = (product(&n.inputs[0]), product(&n.inputs[1])) else {
        return why.no("not a product of two matrix products");
    };
    let ((jg, g, act, tg), (ju, u, _, tu)) = match (a.2, b.2) {
        (Activation::None, Activation::None) => {
            return why.no("neither product has an activation (no gate)")
        }
        (_, Activation::None) => (a, b),
        (Activation::None, _) => (b, a),
        _ => return why.no("both products have an activation"),
    };
    if g.inputs[0] != u.inputs[0] {
        return why.no("the two products do not share their A");
    }
    if tg != tu {
        return why.no("one weight is transposed and the other not");
    }
    for p in [g, u] {
        if p.inputs.get(3).is_some_and(|r| !r.is_empty()) {
            return why.no(format!("'{}' adds a residual", p.name));
        }
        if p.outputs.iter().skip(1).any(|o| !o.is_empty()) {
            return why.no(format!("'{}' has another output read", p.name));
        }
        if cx.sole_consumer(&p.outputs[0]) != Some(i) || cx.needed(&p.outputs[0]) {
            return why.no(format!("'{}' is read elsewhere", p.outputs[0]));
        }
    }
    let (wg, wu) = (&g.inputs[1], &u.inputs[1]);
    if !cx.facts.same_shape(wg, wu) {
        return why.no("the weights differ in shape");
    }
    if !cx.facts.dtype(&n.outputs[0]).is_some_and(|d| d.is_float()) {
        return why.no("not floating");
    }
    let bias = |p: &Node| p.inputs.get(2).cloned().unwrap_or_default();
    let mut inputs = vec![g.inputs[0].clone(), wg.clone(), wu.clone()];
    let (bg, bu) = (bias(g), bias(u));
    if !bg.is_empty() || !bu.is_empty() {
        inputs.extend([bg, bu]);
    }
    let fused = Node {
        name: n.name.clone(),
        op: Op::GatedMatMul {
            activation: act,
            trans_b: tg,
        },
        inputs,
        outputs: n.outputs.clone(),
        loc: n.loc.clone(),
    };
    if let Err(e) = cx.facts.check(std::slice::from_ref(&fused), &n.outputs[0]) {
        return why.no(e);
    }
    Some(Patch {
        remove: vec![jg, ju, i],
        add: vec![fused],
        ..Default::default()
    })
}
