//! Rotary embedding fusion: `x·cos + rotate_half(x)·sin`, which exporters write as two
//! Slices, a Neg, a Concat, two Muls and an Add per rotated tensor, becomes one `Rotary`
//! node (one pass over x instead of seven, and one fused gradient).
//!
//! Rule `rotary_heads` then moves the head transpose exporters write before the rotation
//! (`[B, S, H·D]` → Reshape `[B, S, H, D]` → Transpose `[B, H, S, D]` → rotate) to after
//! it, rotating in the `[B, S, H, D]` layout: the attention fusion then reads the rotated
//! tensors unsplit (3-D Attention) and the copy the transpose made goes.

use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::{BinaryOp, InitSource, Initializer, Node, Op, UnaryOp};
use crate::tensor::Tensor;

pub(crate) const RULES: &[Rule] = &[
    Rule {
        name: "rotary",
        anchor: |op| *op == Op::Binary(BinaryOp::Add),
        run: rotary,
    },
    Rule {
        name: "rotary_heads",
        anchor: |op| matches!(op, Op::Rotary { .. }),
        run: rotary_heads,
    },
];

const HEADS: [usize; 4] = [0, 2, 1, 3];

/// `Rotary(Transpose [0, 2, 1, 3](x), cos, sin)` with x `[B, S, H, D]` (H and D fixed)
/// and the transposed value read only by the Rotary → `Transpose [0, 2, 1, 3](Reshape
/// [B, S, H, D](Reshape [B, S, H·D](Rotary(x, cos', sin'))))`, where cos' and sin' are
/// the tables with their head and sequence axes swapped (an Unsqueeze or a Transpose of
/// a few rows), so they broadcast over x as cos and sin did over the transposed x. The
/// reshapes are views; they give the attention fusion the head split it takes in.
fn rotary_heads(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::Rotary { interleaved } = n.op else {
        return None;
    };
    let heads = Op::Transpose {
        perm: Some(HEADS.to_vec()),
    };
    let Some((jt, t)) = cx.prod(&n.inputs[0], |op| *op == heads) else {
        return why.no("x is not a head transpose (Transpose [0, 2, 1, 3])");
    };
    if cx.sole_consumer(&n.inputs[0]) != Some(i) || cx.needed(&n.inputs[0]) {
        return why.no("the transposed x is read elsewhere");
    }
    let x = &t.inputs[0];
    let shapes = cx.facts.shapes(x)?;
    let (h, d) = match shapes.first() {
        Some(&&[_, _, h, d]) => (h, d),
        _ => return why.no("x is not 4-D"),
    };
    if !shapes
        .iter()
        .all(|s| s.len() == 4 && s[2] == h && s[3] == d)
    {
        return why.no("x's head count or head size is not fixed");
    }
    let base = &n.outputs[0];
    let mut add = vec![];
    let mut inits = vec![];
    let mut tables = vec![];
    for tab in &n.inputs[1..3] {
        let Some(r) = cx.facts.rank(tab) else {
            return why.no("a table's rank is unknown");
        };
        // Axes aligned to [B, H, S, D] from the right; swap H and S.
        let op = match r {
            0 | 1 => {
                tables.push(tab.clone());
                continue;
            }
            2 => Op::Unsqueeze {
                axes: Some(vec![1]),
            },
            3 => Op::Transpose {
                perm: Some(vec![1, 0, 2]),
            },
            4 => heads.clone(),
            _ => return why.no("a table has more axes than x"),
        };
        let v = cx.fresh_value(&format!("{base}/{tab}_bshd"));
        add.push(Node {
            name: cx.fresh_node(&format!("{}/{tab}_bshd", n.name)),
            op,
            inputs: vec![tab.clone()],
            outputs: vec![v.clone()],
            loc: n.loc.clone(),
        });
        tables.push(v);
    }
    let shape = |tag: &str, dims: &[i64], inits: &mut Vec<Initializer>| {
        let name = cx.fresh_value(&format!("{base}/{tag}"));
        inits.push(Initializer {
            name: name.clone(),
            tensor: Tensor::from_vec(&[dims.len()], dims.to_vec()).ok()?,
            trainable: false,
            source: InitSource::Data,
            loc: n.loc.clone(),
        });
        Some(name)
    };
    let merged_shape = shape("merged_shape", &[0, 0, -1], &mut inits)?;
    let split_shape = shape("split_shape", &[0, 0, h as i64, d as i64], &mut inits)?;
    let node = |tag: &str, op: Op, inputs: Vec<String>, out: String| Node {
        name: cx.fresh_node(&format!("{}/{tag}", n.name)),
        op,
        inputs,
        outputs: vec![out],
        loc: n.loc.clone(),
    };
    let rotated = cx.fresh_value(&format!("{base}/bshd"));
    let merged = cx.fresh_value(&format!("{base}/merged"));
    let split = cx.fresh_value(&format!("{base}/split"));
    let mut rot = node(
        "bshd",
        Op::Rotary { interleaved },
        [vec![x.clone()], tables].concat(),
        rotated.clone(),
    );
    rot.name = n.name.clone();
    add.extend([
        rot,
        node(
            "merge",
            Op::Reshape { allowzero: false },
            vec![rotated, merged_shape],
            merged.clone(),
        ),
        node(
            "split",
            Op::Reshape { allowzero: false },
            vec![merged, split_shape],
            split.clone(),
        ),
        node("heads", heads, vec![split], base.clone()),
    ]);
    if let Err(e) = cx.facts.check_with(&add, &inits, base) {
        return why.no(e);
    }
    Some(Patch {
        remove: vec![jt, i],
        add,
        inits,
        ..Default::default()
    })
}

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
        .find(|v| cx.last_axis_slice(v, second, rank).is_some())
    else {
        return why.no("the other product does not multiply the sliced tensor");
    };
    let cos = cx.other(mc, x)?;
    let Some(d) = cx.last_dim(x) else {
        return why.no("x's last dim is not fixed");
    };
    if d % 2 != 0 {
        return why.no("x's last dim is odd");
    }
    let h = d as i64 / 2;
    let (Some(hi), Some(lo)) = (
        cx.last_axis_slice(x, second, rank),
        cx.last_axis_slice(x, first, rank),
    ) else {
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
