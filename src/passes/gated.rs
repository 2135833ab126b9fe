//! Gated-MLP fusion (SwiGLU, GeGLU, GLU): `act(x·Wg + bg) * (x·Wu + bu)`, the gated
//! linear unit of LLaMA-, Mistral-, Qwen- and Gemma-style MLPs, becomes one
//! `GatedMatMul`: both products of one x and their gate in one node, and one fused
//! gradient (dG and dU in one pass) where the unfused form takes a Mul's two gradients
//! and the activation's. Part of the MatMul-epilogue pass: it runs once the gate's
//! activation (and any bias) has gone into a FusedMatMul.

use super::const_fold::{evaluate, init};
use super::pattern::{Ctx, Patch, Why};
use crate::graph::{Activation, BinaryOp, Node, Op};
use crate::tensor::Tensor;

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

/// A gate and an up projection packed into one product (Phi-3's `gate_up_proj`):
/// `x·[Wg | Wu]` (a MatMul, or a FusedMatMul with no activation or residual; a 2-D
/// weight) cut into its two halves along the last axis by a Split or two Slices, where
/// one half gates the other (a Mul reads one half and a value computed from the other).
/// The product becomes one MatMul per half of the weight (and bias), each writing its
/// half, so that `matmul_epilogue` and `gated_matmul` then fuse them as any gated MLP. A
/// constant weight is cut here, once; a trained one through Slices, which pass its
/// gradient back. Shape nodes reading the packed product (the TorchScript exporter
/// computes the halves' bounds from its shape) may stay only if they serve those bounds.
pub(super) fn unpack_gate_up(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let p = cx.node(i);
    let trans_b = match p.op {
        Op::MatMul => false,
        Op::FusedMatMul {
            activation: Activation::None,
            trans_b,
        } => trans_b,
        _ => return None,
    };
    let gu = &p.outputs[0];
    let rank = cx.facts.rank(gu)?;
    let d = cx.last_dim(gu)?;
    if rank < 2 || d % 2 != 0 || cx.needed(gu) {
        return None;
    }
    let h = (d / 2) as i64;
    // The nodes cutting the product, and the two halves in order.
    let (mut cut, mut halves) = (vec![], [None, None]);
    let mut shapes = vec![];
    for &c in cx.consumers(gu) {
        let n = cx.node(c);
        match &n.op {
            Op::Split { axis, .. }
                if (*axis == -1 || *axis == rank as i64 - 1)
                    && n.outputs.len() == 2
                    && n.outputs.iter().all(|o| cx.last_dim(o) == Some(d / 2)) =>
            {
                cut.push(c);
                halves = [Some(&n.outputs[0]), Some(&n.outputs[1])];
            }
            Op::Slice => match cx.last_axis_slice(gu, &n.outputs[0], rank) {
                Some((_, (0, e))) if e == h => {
                    cut.push(c);
                    halves[0] = Some(&n.outputs[0]);
                }
                Some((_, (s, e))) if s == h && e == 2 * h => {
                    cut.push(c);
                    halves[1] = Some(&n.outputs[0]);
                }
                _ => return None,
            },
            Op::Shape { .. } => shapes.push(c),
            _ => return None,
        }
    }
    let ([Some(h0), Some(h1)], 1 | 2) = (halves, cut.len()) else {
        return None;
    };
    // One half gates the other: a Mul of one half and a value computed from the other.
    let gates = |g: &str, u: &str| {
        cx.consumers(u).iter().any(|&m| {
            let m = cx.node(m);
            m.op == Op::Binary(BinaryOp::Mul)
                && cx
                    .other(m, u)
                    .is_some_and(|o| o != g && cx.reaches_from(g, o, 6))
        })
    };
    if !gates(h0, h1) && !gates(h1, h0) {
        return None;
    }
    if let Some(&s) = shapes.iter().find(|&&s| !cx.feeds_only(s, &cut, 8)) {
        return why.no(format!(
            "'{}' reads the packed gate and up product for more than its halves' bounds",
            cx.node(s).name
        ));
    }
    let (a, w) = (&p.inputs[0], &p.inputs[1]);
    let bias = p.inputs.get(2).filter(|b| !b.is_empty());
    if p.inputs.get(3).is_some_and(|r| !r.is_empty())
        || p.outputs.iter().skip(1).any(|o| !o.is_empty())
    {
        return why.no("the packed product adds a residual or writes Pre");
    }
    if cx.facts.rank(w) != Some(2) {
        return why.no("the packed weight is not 2-D");
    }
    let mut patch = Patch {
        remove: [vec![i], cut].concat(),
        ..Default::default()
    };
    // Each half as the exporter would have written a projection of its own: a MatMul
    // (of the transposed weight half, when B was read transposed) and an Add of the bias
    // half, which `matmul_epilogue` folds back into a FusedMatMul with the activation.
    for (k, half) in [h0, h1].into_iter().enumerate() {
        let range = (k as i64 * h, (k as i64 + 1) * h);
        let mut wk = part(cx, w, trans_b as i64 ^ 1, range, &mut patch)?;
        let node = |name: &str, op: Op, inputs: Vec<String>, out: &str| Node {
            name: cx.fresh_node(&format!("{}/{name}{k}", p.name)),
            op,
            inputs,
            outputs: vec![out.to_string()],
            loc: p.loc.clone(),
        };
        if trans_b {
            let t = cx.fresh_value(&format!("{wk}/t"));
            let perm = Some(vec![1, 0]);
            patch
                .add
                .push(node("transpose", Op::Transpose { perm }, vec![wk], &t));
            wk = t;
        }
        let prod = match bias {
            Some(_) => cx.fresh_value(&format!("{half}/product")),
            None => half.clone(),
        };
        patch
            .add
            .push(node("part", Op::MatMul, vec![a.clone(), wk], &prod));
        if let Some(b) = bias {
            let bk = part(cx, b, 0, range, &mut patch)?;
            patch.add.push(node(
                "bias",
                Op::Binary(BinaryOp::Add),
                vec![prod, bk],
                half,
            ));
        }
    }
    for half in [h0, h1] {
        if let Err(e) = cx.facts.check_with(&patch.add, &patch.inits, half) {
            return why.no(e);
        }
    }
    Some(patch)
}

/// `v[lo..hi]` along `axis`: a new initializer when `v` is a constant nobody trains, else
/// a Slice node (and its bounds) added to `patch`. Returns the part's name.
fn part(cx: &Ctx, v: &str, axis: i64, (lo, hi): (i64, i64), patch: &mut Patch) -> Option<String> {
    let name = cx.fresh_value(&format!("{v}/{lo}_{hi}"));
    let bound = |what: &str, x: i64| {
        let t = Tensor::from_vec(&[1], vec![x]).expect("one element");
        init(&cx.fresh_value(&format!("{name}/{what}")), t)
    };
    let bounds = [bound("starts", lo), bound("ends", hi), bound("axes", axis)];
    let slice = Node {
        name: cx.fresh_node(&name),
        op: Op::Slice,
        inputs: std::iter::once(v.to_string())
            .chain(bounds.iter().map(|b| b.name.clone()))
            .collect(),
        outputs: vec![name.clone()],
        loc: None,
    };
    match cx.konst(v).filter(|_| !cx.trainable(v)) {
        Some(t) => {
            let args: Vec<Option<&Tensor>> = std::iter::once(t)
                .chain(bounds.iter().map(|b| &b.tensor))
                .map(Some)
                .collect();
            let [value] = <[Tensor; 1]>::try_from(evaluate(cx, &slice, &args, usize::MAX)?).ok()?;
            patch.inits.push(init(&name, value));
        }
        None => {
            patch.inits.extend(bounds);
            patch.add.push(slice);
        }
    }
    Some(name)
}
