//! Common-subexpression elimination: two nodes with the same op, the same attributes and
//! the same inputs (in either order for Add, Mul and Equal) compute the same values, so one of them goes and its readers read the
//! other. The earlier one is kept unless only the later one produces a graph output.

use super::pattern::{Ctx, Patch, Why};
use super::{any_op, Rule};
use crate::graph::{Node, Op};

pub(crate) const RULES: &[Rule] = &[Rule {
    name: "cse",
    anchor: any_op,
    run: cse,
}];

/// Ops whose two inputs can be swapped: Add(a, b) and Add(b, a) are one value.
fn commutative(op: &Op) -> bool {
    use crate::graph::BinaryOp as B;
    matches!(op, Op::Binary(B::Add | B::Mul | B::Equal))
}

fn same(a: &Node, b: &Node) -> bool {
    let swapped = || {
        commutative(&a.op)
            && matches!((a.inputs.as_slice(), b.inputs.as_slice()), ([x, y], [p, q]) if x == q && y == p)
    };
    a.op == b.op
        && (a.inputs == b.inputs || swapped())
        && a.outputs.len() == b.outputs.len()
        && a.outputs
            .iter()
            .zip(&b.outputs)
            .all(|(x, y)| x.is_empty() == y.is_empty())
}

fn merge(cx: &Ctx, gone: usize, kept: usize) -> Option<Patch> {
    let (g, k) = (cx.node(gone), cx.node(kept));
    if g.outputs.iter().any(|o| cx.needed(o)) {
        return None;
    }
    let rewire = g
        .outputs
        .iter()
        .zip(&k.outputs)
        .filter(|(o, _)| !o.is_empty())
        .map(|(o, k)| (o.clone(), k.clone()))
        .collect();
    Some(Patch {
        remove: vec![gone],
        rewire,
        ..Default::default()
    })
}

fn cse(cx: &Ctx, i: usize, _: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    // Each random node draws its own values: two of them are not the same computation.
    if n.op.is_random() {
        return None;
    }
    let earlier = |j: &usize| *j != i && cx.pos[*j] < cx.pos[i] && same(cx.node(*j), n);
    let j = match n.input(0) {
        Some(v) => cx.consumers(v).iter().copied().find(earlier)?,
        None => (0..cx.g.nodes.len()).find(earlier)?,
    };
    merge(cx, i, j).or_else(|| merge(cx, j, i))
}
