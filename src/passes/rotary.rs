//! Rotary embedding fusion: `x·cos + rotate_half(x)·sin`, which exporters write as two
//! Slices, a Neg, a Concat, two Muls and an Add per rotated tensor, becomes one `Rotary`
//! node (one pass over x instead of seven, and one fused gradient).

use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::{BinaryOp, Node, Op, UnaryOp};

pub(crate) const RULES: &[Rule] = &[Rule {
    name: "rotary",
    anchor: |op| *op == Op::Binary(BinaryOp::Add),
    run: rotary,
}];

/// `Add(Mul(x, cos), Mul(Concat(Neg(x[.., h:]), x[.., :h]), sin))`, each Mul and the Add
/// in either operand order, where h is half of x's (fixed, even) last dim and the two
/// Slices take exactly the halves on the last axis; cos and sin broadcast to x. Every
/// intermediate must be read only by the next step.
fn rotary(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let is_mul = |op: &Op| *op == Op::Binary(BinaryOp::Mul);
    let muls: Vec<(usize, &Node)> = n
        .inputs
        .iter()
        .filter_map(|v| {
            cx.prod(v, is_mul)
                .filter(|_| cx.sole_consumer(v) == Some(i))
        })
        .collect();
    let [a, b] = muls.as_slice() else {
        return why.no("not a sum of two products read only by it");
    };
    // Which product holds the rotated half: the one with a Concat operand.
    let concat_in = |m: &Node| {
        m.inputs.iter().position(|v| {
            cx.prod(v, |op| matches!(op, Op::Concat { .. }))
                .is_some_and(|_| cx.sole_consumer(v).is_some())
        })
    };
    let ((jc, mc), (jr, mr), k) = match (concat_in(a.1), concat_in(b.1)) {
        (_, Some(k)) => (*a, *b, k),
        (Some(k), None) => (*b, *a, k),
        (None, None) => return why.no("neither product has a rotated half (a Concat)"),
    };
    let rotated = &mr.inputs[k];
    let sin = &mr.inputs[1 - k];
    let (jcat, cat) = cx.prod(rotated, |op| matches!(op, Op::Concat { .. }))?;
    let Some(rank) = cx.facts.rank(rotated) else {
        return why.no("the rank is unknown");
    };
    let Op::Concat { axis } = cat.op else {
        return None;
    };
    if axis != -1 && axis != rank as i64 - 1 {
        return why.no("the halves are not joined on the last axis");
    }
    let [neg, first] = cat.inputs.as_slice() else {
        return why.no("the Concat does not join two halves");
    };
    let Some((jneg, ng)) = cx.prod(neg, |op| *op == Op::Unary(UnaryOp::Neg)) else {
        return why.no("the rotated half does not start with a Neg");
    };
    if cx.sole_consumer(neg) != Some(jcat) {
        return why.no("the negated half is read elsewhere");
    }
    let second = &ng.inputs[0];
    // x is what the product with cos multiplies, and what both halves are sliced from.
    let Some(x) = mc
        .inputs
        .iter()
        .find(|v| half_of(cx, v, second, rank).is_some())
    else {
        return why.no("the other product does not multiply the sliced tensor");
    };
    let cos = cx.other(mc, x)?;
    let Some(d) = last_dim(cx, x) else {
        return why.no("x's last dim is not fixed");
    };
    if d % 2 != 0 {
        return why.no("x's last dim is odd");
    }
    let h = d as i64 / 2;
    let (Some(hi), Some(lo)) = (half_of(cx, x, second, rank), half_of(cx, x, first, rank)) else {
        return why.no("the halves are not Slices of x");
    };
    // Each half must be exactly [h, d) (the negated one) and [0, h).
    if hi.1 != (h, d as i64) || lo.1 != (0, h) {
        return why.no("the Slices do not take x's two halves");
    }
    for (v, j) in [(second, jneg), (first, jcat)] {
        if cx.sole_consumer(v) != Some(j) {
            return why.no("a half is read elsewhere");
        }
    }
    let fused = Node {
        name: n.name.clone(),
        op: Op::Rotary { interleaved: false },
        inputs: vec![x.clone(), cos.to_string(), sin.clone()],
        outputs: n.outputs.clone(),
        loc: n.loc.clone(),
    };
    if let Err(e) = cx.facts.check(std::slice::from_ref(&fused), &n.outputs[0]) {
        return why.no(e);
    }
    Some(Patch {
        remove: vec![lo.0, hi.0, jneg, jcat, jr, jc, i],
        add: vec![fused],
        ..Default::default()
    })
}

/// When `v` is a Slice of `x` on its last axis with step 1 and bounds that are constants
/// (or computed from x's fixed last dim, as the TorchScript exporter writes `D // 2`):
/// the Slice's node and its [start, end) clamped to x's last dim.
fn half_of(cx: &Ctx, x: &str, v: &str, rank: usize) -> Option<(usize, (i64, i64))> {
    let (j, s) = cx.prod(v, |op| *op == Op::Slice)?;
    if s.inputs[0] != x {
        return None;
    }
    let d = last_dim(cx, x)? as i64;
    let ints = |k: usize| -> Option<Vec<i64>> {
        match s.inputs.get(k).filter(|v| !v.is_empty()) {
            Some(v) => Some(cx.konst(v).or(cx.facts.value(v))?.to_i64_vec()),
            None => None,
        }
    };
    let (starts, ends) = (ints(1)?, ints(2)?);
    let axes = ints(3).unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = ints(4).unwrap_or_else(|| vec![1; starts.len()]);
    let last = |a: i64| a == -1 || a == rank as i64 - 1;
    let ([s0], [e0], [a0], [1]) = (&starts[..], &ends[..], &axes[..], &steps[..]) else {
        return None;
    };
    if !last(*a0) {
        return None;
    }
    let clamp = |b: i64| if b < 0 { (b + d).max(0) } else { b.min(d) };
    Some((j, (clamp(*s0), clamp(*e0))))
}

/// The size of `x`'s last axis, when it is the same in every inference run.
fn last_dim(cx: &Ctx, x: &str) -> Option<usize> {
    let shapes = cx.facts.shapes(x)?;
    let d = *shapes.first()?.last()?;
    shapes.iter().all(|s| s.last() == Some(&d)).then_some(d)
}
