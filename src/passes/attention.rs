//! Attention fusion, anchored on the Softmax:
//! `MatMul(Q, Transpose(K)) → Mul|Div(scale) → [Add(mask) | Where(mask, ·, -big) |
//! Where(causal drop-mask, -big, ·)] → Softmax(-1) → MatMul(·, V)` becomes one `Attention`
//! on `[B, H, S, D]` tensors.
//! Scales may also sit on Q and K; their product is the `scale` attribute. A causal mask
//! (Trilu of ones through Shape/Expand/Cast, or a constant lower-triangular mask) becomes
//! `is_causal` and its subgraph goes. When K was split into heads as `[B, S, H, D]` and
//! transposed with perm [0, 2, 3, 1], a Transpose [0, 2, 1, 3] gives Attention its K; a Kᵀ
//! written as Reshape → Transpose [0, 2, 1] → Reshape over merged heads is recognised too.
//! K and V repeated to the query heads (grouped-query attention) are read un-repeated.

use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::{BinaryOp, Node, Op};
use crate::tensor::{DType, Tensor};

pub(crate) const RULES: &[Rule] = &[Rule {
    name: "attention",
    anchor: |op| matches!(op, Op::Softmax { .. }),
    run: fuse,
}];

/// Masked-out scores at or below this are "minus infinity" for softmax in f32.
const BIG_NEGATIVE: f64 = -1e4;

/// The `Q Kᵀ · scale` half of the pattern.
struct Scores<'g> {
    q: &'g str,
    k: &'g str,
    /// K is `[B, S, H, D]` (the Transpose had perm [0, 2, 3, 1]).
    k_bshd: bool,
    scale: f64,
    /// The QK MatMul and the scale nodes after it.
    nodes: Vec<usize>,
}

fn fuse(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let sm = cx.node(i);
    let Op::Softmax { axis } = sm.op else {
        return None;
    };
    let z = sm.inputs[0].as_str();
    if !(axis == -1 || cx.facts.rank(z).is_some_and(|r| axis == r as i64 - 1)) {
        return why.no(format!("Softmax axis {axis} is not the last axis"));
    }
    let p = &sm.outputs[0];
    let Some(pv_i) = cx.sole_consumer(p) else {
        return why.no(format!(
            "'{p}' is read by {} nodes or is a graph output",
            cx.consumers(p).len()
        ));
    };
    let pv = cx.node(pv_i);
    if pv.op != Op::MatMul || pv.inputs[0] != *p {
        return why.no(format!(
            "'{p}' does not feed the left side of a MatMul (P·V)"
        ));
    }
    let mut core = vec![i, pv_i];
    let mut mask: Option<&str> = None;
    let mut causal: Option<Vec<usize>> = None;
    let scores: Scores;
    if let Some((wi, w)) = cx.prod(z, |op| matches!(op, Op::Where)) {
        // `Where(keep, scores, -big)`, or `Where(drop, -big, scores)` as PyTorch's
        // masked_fill exports (the mask is true where scores are masked out).
        let big = |v: &str| cx.scalar(v).is_some_and(|x| x <= BIG_NEGATIVE);
        let (s, keep_when_true) = if big(&w.inputs[2]) {
            (&w.inputs[1], true)
        } else if big(&w.inputs[1]) {
            (&w.inputs[2], false)
        } else {
            return why.no(format!(
                "Where '{}' puts no big negative scalar where its mask is false (or, as masked_fill writes it, true)",
                w.name
            ));
        };
        scores = match qk(cx, s) {
            Ok(s) => s,
            Err(e) => return why.no(e),
        };
        core.push(wi);
        match causal_keep(cx, &w.inputs[0], &scores, keep_when_true) {
            Some(chain) => causal = Some(chain),
            None if keep_when_true => mask = Some(&w.inputs[0]),
            // Attention's bool mask keeps where true; a drop-mask would need a negation.
            None => {
                return why.no(format!(
                    "Where '{}' masks out where its mask is true, and the mask is not causal",
                    w.name
                ))
            }
        }
    } else if let Some((ai, add)) = cx.prod(z, |op| *op == Op::Binary(BinaryOp::Add)) {
        let (s, m) = match (qk(cx, &add.inputs[0]), qk(cx, &add.inputs[1])) {
            (Ok(s), _) => (s, &add.inputs[1]),
            (_, Ok(s)) => (s, &add.inputs[0]),
            // Report on the operand that could have been the scores, not the constant.
            (Err(e), Err(f)) => {
                return why.no(if cx.konst(&add.inputs[0]).is_some() {
                    f
                } else {
                    e
                })
            }
        };
        scores = s;
        core.push(ai);
        if causal_additive(cx, m, &scores) {
            causal = Some(vec![]);
        } else {
            mask = Some(m);
        }
    } else {
        scores = match qk(cx, z) {
            Ok(s) => s,
            Err(e) => return why.no(e),
        };
    }
    core.extend(&scores.nodes);
    if !(scores.scale.is_finite() && scores.scale != 0.0) {
        return why.no(format!(
            "scale {} is not a finite non-zero number",
            scores.scale
        ));
    }
    let out = pv.outputs[0].as_str();
    // The causal mask's own nodes go too when they read the scores (Shape of them).
    let with_chain: Vec<usize> = core
        .iter()
        .chain(causal.iter().flatten())
        .copied()
        .collect();
    let remove = if cx.swallow_ok(&with_chain, out).is_ok() {
        with_chain
    } else {
        core
    };
    if let Err(e) = cx.swallow_ok(&remove, out) {
        return why.no(e);
    }

    // Grouped-query heads: K and V repeated to the query heads are read before the repeat
    // (the repeat's nodes go with the last reader). Both or neither, by the same factor.
    let (mut k, mut v) = (scores.k, pv.inputs[1].as_str());
    if !scores.k_bshd {
        if let (Some((k0, nk)), Some((v0, nv))) = (repeated(cx, k), repeated(cx, v)) {
            if nk == nv {
                (k, v) = (k0, v0);
            }
        }
    }
    let mut add = vec![];
    let mut k = k.to_string();
    if scores.k_bshd {
        let name = cx.fresh_node(&format!("{}_k_transpose", pv.name));
        let value = cx.fresh_value(&format!("{k}_bhsd"));
        add.push(Node {
            name,
            op: Op::Transpose {
                perm: Some(vec![0, 2, 1, 3]),
            },
            inputs: vec![k],
            outputs: vec![value.clone()],
            loc: pv.loc.clone(),
        });
        k = value;
    }
    let mut inputs = vec![scores.q.to_string(), k, v.to_string()];
    inputs.extend(mask.map(str::to_string));
    let op = Op::Attention {
        is_causal: causal.is_some(),
        scale: Some(scores.scale as f32),
    };
    add.push(Node {
        name: pv.name.clone(),
        op,
        inputs,
        outputs: vec![out.to_string()],
        loc: pv.loc.clone(),
    });
    if cx.facts.complete() {
        if let Err(e) = cx.facts.check(&add, out) {
            return why.no(e);
        }
    } else {
        let rank4 = |v: &str| cx.facts.rank(v) == Some(4);
        if !(rank4(scores.q) && rank4(scores.k) && rank4(&pv.inputs[1]) && mask.is_none()) {
            return why.no("shapes are unknown: Q, K and V must be known 4-D and the mask causal");
        }
    }
    Some(Patch {
        remove,
        add,
        ..Default::default()
    })
}

/// `v = x * c`, `c * x` or `x / c` with `c` a scalar constant: (node, x, multiplier).
fn scaled<'g>(cx: &Ctx<'g>, v: &str) -> Option<(usize, &'g str, f64)> {
    let (i, n) = cx.prod(v, |op| {
        matches!(op, Op::Binary(BinaryOp::Mul | BinaryOp::Div))
    })?;
    let (a, b) = (n.inputs[0].as_str(), n.inputs[1].as_str());
    match n.op {
        Op::Binary(BinaryOp::Div) => cx.scalar(b).map(|c| (i, a, 1.0 / c)),
        _ => match (cx.scalar(a), cx.scalar(b)) {
            (_, Some(c)) => Some((i, a, c)),
            (Some(c), None) => Some((i, b, c)),
            _ => None,
        },
    }
}

/// Strips scalar scales off `v` while nothing else reads the scaled value.
fn unscale<'g>(cx: &Ctx<'g>, mut v: &'g str, scale: &mut f64) -> &'g str {
    while let Some((_, x, c)) = scaled(cx, v).filter(|_| cx.sole_consumer(v).is_some()) {
        *scale *= c;
        v = x;
    }
    v
}

/// Matches `s` = `MatMul(Q, Transpose(K)) · scale`.
fn qk<'g>(cx: &Ctx<'g>, s: &'g str) -> Result<Scores<'g>, String> {
    let (mut scale, mut nodes, mut v) = (1.0, vec![], s);
    while let Some((i, x, c)) = scaled(cx, v) {
        nodes.push(i);
        scale *= c;
        v = x;
    }
    let Some((mi, mm)) = cx.prod(v, |op| *op == Op::MatMul) else {
        return Err(format!("'{v}' is not a MatMul(Q, Kᵀ) (times a scalar)"));
    };
    nodes.push(mi);
    let q = unscale(cx, &mm.inputs[0], &mut scale);
    let kt = unscale(cx, &mm.inputs[1], &mut scale);
    let (k, k_bshd) = if let Some(k) = flat_transposed(cx, kt) {
        (k, false)
    } else {
        let Some((_, t)) = cx.prod(kt, |op| matches!(op, Op::Transpose { .. })) else {
            return Err(format!(
                "the right side of MatMul '{}' is not a Transpose of K",
                mm.name
            ));
        };
        let k_bshd = match &t.op {
            Op::Transpose { perm: Some(p) } if p == &[0, 1, 3, 2] => false,
            Op::Transpose { perm: Some(p) } if p == &[0, 2, 3, 1] => true,
            _ => {
                return Err(format!(
                    "Transpose '{}' has no perm [0, 1, 3, 2] or [0, 2, 3, 1]",
                    t.name
                ))
            }
        };
        (t.inputs[0].as_str(), k_bshd)
    };
    let k = unscale(cx, k, &mut scale);
    Ok(Scores {
        q,
        k,
        k_bshd,
        scale,
        nodes,
    })
}

/// `Kᵀ` as the dynamo exporter writes it for scaled_dot_product_attention: K `[B, H, S, D]`
/// reshaped to `[B·H, S, D]`, transposed with perm [0, 2, 1] and reshaped back to
/// `[B, H, D, S]`. Returns K. Needs static shapes: the reshapes must only merge and split
/// the leading dims, which is what makes the chain a plain transpose of the last two.
fn flat_transposed<'g>(cx: &Ctx<'g>, kt: &str) -> Option<&'g str> {
    let (_, r2) = cx.prod(kt, |op| matches!(op, Op::Reshape { .. }))?;
    let (_, t) = cx.prod(&r2.inputs[0], |op| {
        *op == Op::Transpose {
            perm: Some(vec![0, 2, 1]),
        }
    })?;
    let (_, r1) = cx.prod(&t.inputs[0], |op| matches!(op, Op::Reshape { .. }))?;
    let k = r1.inputs[0].as_str();
    let [b, h, s, d] = cx.facts.static_shape(k)?[..] else {
        return None;
    };
    let merged = cx.facts.static_shape(&r1.outputs[0])? == [b * h, s, d];
    let split = cx.facts.static_shape(kt)? == [b, h, d, s];
    (merged && split).then_some(k)
}

/// `v` = `x` `[B, Hkv, S, D]` with each head repeated `n` times in a row, so that head h
/// of `v` is head h / n of `x`: Attention's grouped-query layout. Two forms: HF's
/// repeat_kv (also torch's repeat_interleave on the head axis) `Unsqueeze(2) → Expand →
/// Reshape` (any Reshape that inserts the unit axis in place of the Unsqueeze), and for
/// one kv head a plain `Expand` `[B, 1, S, D]` → `[B, H, S, D]`. Shapes are checked in
/// every inference run, so the factor is the same for any symbol value. `K.repeat(1, n, 1, 1)`
/// (head h reads kv head h mod Hkv) has the wrong layout and is not matched: its
/// unsqueezed shape would be `[B, 1, Hkv, S, D]`.
fn repeated<'g>(cx: &Ctx<'g>, v: &str) -> Option<(&'g str, usize)> {
    let shapes = |v: &str| cx.facts.shapes(v);
    if let Some((_, e)) = cx.prod(v, |op| *op == Op::Expand) {
        let x = e.inputs[0].as_str();
        let (xs, vs) = (shapes(x)?, shapes(v)?);
        let h = *vs.first()?.get(1)?;
        let one_head = xs.iter().zip(&vs).all(|(a, b)| {
            matches!((a, b), ([b0, 1, s0, d0], [b1, h1, s1, d1])
                if b0 == b1 && s0 == s1 && d0 == d1 && *h1 == h)
        });
        return one_head.then_some((x, h));
    }
    let (_, r) = cx.prod(v, |op| matches!(op, Op::Reshape { .. }))?;
    let (_, e) = cx.prod(&r.inputs[0], |op| *op == Op::Expand)?;
    let (_, u) = cx.prod(&e.inputs[0], |op| {
        matches!(op, Op::Unsqueeze { .. } | Op::Reshape { .. })
    })?;
    let x = u.inputs[0].as_str();
    let (xs, us) = (shapes(x)?, shapes(&u.outputs[0])?);
    let (es, vs) = (shapes(&e.outputs[0])?, shapes(v)?);
    let mut n = None;
    for k in 0..xs.len() {
        let [b, h, s, d] = xs[k][..] else { return None };
        let [eb, eh, en, es_, ed] = es[k][..] else {
            return None;
        };
        let ok = us[k] == [b, h, 1, s, d]
            && (eb, eh, es_, ed) == (b, h, s, d)
            && vs[k] == [b, h * en, s, d]
            && n.is_none_or(|m| m == en);
        if !ok {
            return None;
        }
        n = Some(en);
    }
    Some((x, n?))
}

/// The last two dims of the scores, when static.
fn score_dims(cx: &Ctx, s: &Scores) -> Option<(usize, usize)> {
    let mm = cx.node(*s.nodes.last()?);
    let shape = cx.facts.static_shape(&mm.outputs[0])?;
    let r = shape.len();
    (r >= 2).then(|| (shape[r - 2], shape[r - 1]))
}

/// A constant `[1, .., Sq, Skv]` mask of the scores' size whose element (i, j) is
/// classified by `keep(value, j <= i)`.
fn const_mask(cx: &Ctx, t: &Tensor, s: &Scores, ok: impl Fn(f64, bool) -> bool) -> bool {
    let Some((sq, skv)) = score_dims(cx, s) else {
        return false;
    };
    let shape = t.shape();
    let r = shape.len();
    if r < 2 || shape[r - 2] != sq || shape[r - 1] != skv || shape[..r - 2].iter().any(|&d| d != 1)
    {
        return false;
    }
    let v = t.to_f64_vec();
    (0..sq).all(|i| (0..skv).all(|j| ok(v[i * skv + j], j <= i)))
}

/// A causal bool mask: a keep-mask (`keep_when_true`) that is lower-triangular,
/// `Cast?(Trilu(upper=0, k=0)(ones))` with the ones expanded to `Shape(scores)[-2:]` or a
/// constant; or a constant drop-mask that is true above the diagonal. Returns its nodes.
fn causal_keep(cx: &Ctx, c: &str, s: &Scores, keep_when_true: bool) -> Option<Vec<usize>> {
    let mut chain = vec![];
    let mut v = c;
    if let Some((ci, cast)) = cx.prod(v, |op| matches!(op, Op::Cast { to: DType::Bool })) {
        chain.push(ci);
        v = &cast.inputs[0];
    }
    if let Some(t) = cx.konst(v) {
        let ok = |x: f64, keep: bool| (x != 0.0) == (keep == keep_when_true);
        return const_mask(cx, t, s, ok).then_some(chain);
    }
    if !keep_when_true {
        return None;
    }
    let (ti, tril) = cx.prod(v, |op| *op == Op::Trilu { upper: false })?;
    if tril.input(1).is_some_and(|k| cx.scalar(k) != Some(0.0)) {
        return None;
    }
    chain.push(ti);
    let (ei, expand) = cx.prod(&tril.inputs[0], |op| *op == Op::Expand)?;
    if !cx.scalar(&expand.inputs[0]).is_some_and(|x| x != 0.0) {
        return None;
    }
    chain.push(ei);
    let (si, shape) = cx.prod(&expand.inputs[1], |op| {
        matches!(
            op,
            Op::Shape {
                start: 2 | -2,
                end: None
            }
        )
    })?;
    // Shape of the scores (at any point of their scaling chain): [Sq, Skv].
    let of_scores = s
        .nodes
        .iter()
        .any(|&n| cx.node(n).outputs[0] == shape.inputs[0]);
    of_scores.then(|| {
        chain.push(si);
        chain
    })
}

/// A constant additive mask: 0 on and below the diagonal, a big negative above.
fn causal_additive(cx: &Ctx, m: &str, s: &Scores) -> bool {
    cx.konst(m).is_some_and(|t| {
        const_mask(
            cx,
            t,
            s,
            |x, keep| if keep { x == 0.0 } else { x <= BIG_NEGATIVE },
        )
    })
}
