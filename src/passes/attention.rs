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
//!
//! Rule `attention_heads`, tried first, also takes in the head split and merge around
//! the pattern: Q, K and V split from `[B, S, H·D]` tensors by `Reshape [B, S, H, D] →
//! Transpose` and the output merged back by `Transpose → Reshape [B, S, H·Dv]` make one
//! 3-D `Attention` (`q_num_heads`, `kv_num_heads`) on the unsplit tensors. Where part of
//! that is missing, or a value in between has another reader, rule `attention` fuses the
//! 4-D form and the copies stay.
//!
//! Rule `attention_flat` (its own file) takes the form written on `[B·H, S, D]` stacks
//! with a per-head bias (BLOOM's ALiBi).
//!
//! Rule `attention_qkv`, anchored on a 3-D `Attention`, takes in the Split of one QKV
//! projection: Q, K and V that are the three outputs, in order, of a Split on the last
//! axis into `Hq·D, Hkv·D, Hkv·D` (equal for multi-head attention), read by nothing
//! else, make Attention read the packed tensor itself (K and V omitted). The kernels
//! read the parts in place, and its gradient is one packed dQKV: the Split's copies and
//! the backward's Concat go.

use super::pattern::{Ctx, Patch, Why};
use super::Rule;
use crate::graph::{BinaryOp, Node, Op};
use crate::tensor::{DType, Tensor};

/// The 3-D rule first: where it does not apply, the 4-D one does.
pub(crate) const RULES: &[Rule] = &[
    Rule {
        name: "attention_heads",
        anchor: |op| matches!(op, Op::Softmax { .. }),
        run: fuse_heads,
    },
    Rule {
        name: "attention",
        anchor: |op| matches!(op, Op::Softmax { .. }),
        run: fuse,
    },
    Rule {
        name: "attention_flat",
        anchor: |op| matches!(op, Op::Softmax { .. }),
        run: super::attention_flat::fuse_flat,
    },
    Rule {
        name: "attention_qkv",
        anchor: |op| matches!(op, Op::Attention { .. }),
        run: fuse_qkv,
    },
];

/// A 3-D Attention whose Q, K and V are the outputs of one Split on the last axis into
/// `Hq·D, Hkv·D, Hkv·D`, each read only by it, reads the Split's input packed (see the
/// module comment).
fn fuse_qkv(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let n = cx.node(i);
    let Op::Attention {
        q_num_heads: Some(hq),
        kv_num_heads: Some(hkv),
        ..
    } = n.op
    else {
        return why.no("not the 3-D form (q_num_heads, kv_num_heads)");
    };
    let qkv = &n.inputs[..3];
    if qkv.iter().any(|v| v.is_empty()) {
        return why.no("Q, K and V are packed already");
    }
    let Some((si, split)) = cx.prod(&qkv[0], |op| matches!(op, Op::Split { .. })) else {
        return why.no(format!("Q '{}' is not split from a QKV tensor", qkv[0]));
    };
    if split.outputs != qkv {
        return why.no(format!(
            "Q, K and V are not the three outputs of Split '{}' in order",
            split.name
        ));
    }
    if let Some(v) = qkv.iter().find(|v| cx.sole_consumer(v) != Some(i)) {
        return why.no(format!(
            "'{v}' is read by another node or is a graph output"
        ));
    }
    if n.inputs.get(3).is_some_and(|m| qkv.contains(m)) {
        return why.no("the mask is one of Q, K and V");
    }
    let x = &split.inputs[0];
    let Op::Split { axis, .. } = split.op else {
        unreachable!("matched above")
    };
    // The last axis, and parts of Hq·D, Hkv·D, Hkv·D (D from Q), in every inference run.
    let (Some(xs), Some(parts)) = (
        cx.facts.shapes(x),
        qkv.iter()
            .map(|v| cx.facts.shapes(v))
            .collect::<Option<Vec<_>>>(),
    ) else {
        return why.no("shapes are unknown");
    };
    let fits = xs.iter().enumerate().all(|(r, xs)| {
        let [q, k, v] = [0, 1, 2].map(|p| parts[p][r].last().copied().unwrap_or(0));
        let last = axis == -1 || axis == xs.len() as i64 - 1;
        let d = q / hq.max(1);
        last && xs.len() == 3 && q == hq * d && k == hkv * d && v == hkv * d
    });
    if !fits {
        return why.no(format!(
            "Split '{}' is not on the last axis into Hq·D, Hkv·D, Hkv·D",
            split.name
        ));
    }
    let mut fused = n.clone();
    fused.inputs[..3].clone_from_slice(&[x.clone(), String::new(), String::new()]);
    let out = &n.outputs[0];
    if let Err(e) = cx.facts.check(std::slice::from_ref(&fused), out) {
        return why.no(e);
    }
    Some(Patch {
        remove: vec![si, i],
        add: vec![fused],
        ..Default::default()
    })
}

/// Masked-out scores at or below this are "minus infinity" for softmax in f32.
const BIG_NEGATIVE: f64 = -1e4;

/// The `Q Kᵀ · scale` half of the pattern.
struct Scores<'g> {
    /// The QK MatMul's inputs.
    q_in: &'g str,
    kt_in: &'g str,
    q: &'g str,
    k: &'g str,
    /// K is `[B, S, H, D]` (the Transpose had perm [0, 2, 3, 1]).
    k_bshd: bool,
    scale: f64,
    /// The QK MatMul and the scale nodes after it.
    nodes: Vec<usize>,
}

/// What the Softmax-anchored pattern matched, before either rule builds its node.
struct Match<'g> {
    /// The QK MatMul, the scales, the mask op, the Softmax and the PV MatMul.
    core: Vec<usize>,
    /// The causal mask's own nodes, when they may go too.
    chain: Vec<usize>,
    /// The PV MatMul: its name and output are the fused node's.
    pv: &'g Node,
    /// What the QK MatMul reads (Q and Kᵀ, scales included).
    q_in: &'g str,
    kt_in: &'g str,
    q: &'g str,
    /// K as Attention reads it (`[B, S, H, D]` when `k_bshd`) and V, read before any
    /// grouped-query repeat.
    k: &'g str,
    v: &'g str,
    k_bshd: bool,
    mask: Option<&'g str>,
    causal: bool,
    scale: f64,
}

impl Match<'_> {
    /// The nodes the fused node replaces: with the causal chain if nothing else reads it.
    fn remove(&self, cx: &Ctx, extra: &[usize], out: &str) -> Result<Vec<usize>, String> {
        let with = |chain: &[usize]| -> Vec<usize> {
            self.core
                .iter()
                .chain(chain)
                .chain(extra)
                .copied()
                .collect()
        };
        let all = with(&self.chain);
        if cx.swallow_ok(&all, out).is_ok() {
            return Ok(all);
        }
        let some = with(&[]);
        cx.swallow_ok(&some, out).map(|_| some)
    }
}

/// The 4-D form: `Attention` on `[B, H, S, D]` tensors.
fn fuse(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let m = matched(cx, i, why)?;
    let pv = m.pv;
    let out = pv.outputs[0].as_str();
    let remove = match m.remove(cx, &[], out) {
        Ok(r) => r,
        Err(e) => return why.no(e),
    };
    let mut add = vec![];
    let mut k = m.k.to_string();
    if m.k_bshd {
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
    let mut inputs = vec![m.q.to_string(), k, m.v.to_string()];
    inputs.extend(m.mask.map(str::to_string));
    add.push(attention_node(&m, inputs, out, None));
    if cx.facts.complete() {
        if let Err(e) = cx.facts.check(&add, out) {
            return why.no(e);
        }
    } else {
        let rank4 = |v: &str| cx.facts.rank(v) == Some(4);
        if !(rank4(m.q) && rank4(m.k) && rank4(m.v) && m.mask.is_none()) {
            return why.no("shapes are unknown: Q, K and V must be known 4-D and the mask causal");
        }
    }
    Some(Patch {
        remove,
        add,
        ..Default::default()
    })
}

fn attention_node(
    m: &Match,
    inputs: Vec<String>,
    out: &str,
    heads: Option<(usize, usize)>,
) -> Node {
    Node {
        name: m.pv.name.clone(),
        op: Op::Attention {
            is_causal: m.causal,
            scale: Some(m.scale as f32),
            q_num_heads: heads.map(|h| h.0),
            kv_num_heads: heads.map(|h| h.1),
        },
        inputs,
        outputs: vec![out.to_string()],
        loc: m.pv.loc.clone(),
    }
}

/// The 3-D form: when Q, K and V were split into heads as `Reshape [B, S, H, D] →
/// Transpose` from `[B, S, H·D]` tensors and the output is merged back as `Transpose →
/// Reshape [B, S, H·Dv]`, one `Attention` with `q_num_heads`/`kv_num_heads` reads the
/// unsplit tensors and writes the merged output: the four copies go. Every value in
/// between must be read by nothing else; otherwise (or for a partial pattern) the 4-D
/// rule fuses as before.
fn fuse_heads(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    // Why the pattern itself failed is the 4-D rule's to say.
    let m = matched(cx, i, &mut Why::default())?;
    let pv = m.pv;
    let Some((q3, hq, d)) = split_heads(cx, m.q, false) else {
        return why.no(format!(
            "Q '{}' is not split into heads from [B, S, H·D] by Reshape → Transpose [0, 2, 1, 3]",
            m.q
        ));
    };
    let Some((k3, hkv, dk)) = split_heads(cx, m.k, m.k_bshd) else {
        return why.no(format!(
            "K '{}' is not split into heads from [B, S, H·D]",
            m.k
        ));
    };
    let Some((v3, hv, _)) = split_heads(cx, m.v, false) else {
        return why.no(format!(
            "V '{}' is not split into heads from [B, S, H·D]",
            m.v
        ));
    };
    if (hv, dk) != (hkv, d) {
        return why.no("K and V are split into different heads");
    }
    let Some((merge, out)) = merged_heads(cx, &pv.outputs[0]) else {
        return why.no(format!(
            "'{}' is not merged back by Transpose [0, 2, 1, 3] → Reshape [B, S, H·Dv] (alone)",
            pv.outputs[0]
        ));
    };
    // The copies between the unsplit tensors and the MatMuls (scales and repeats too).
    let stops = [q3, k3, v3];
    let Some(mut extra) = between(cx, &[m.q_in, m.kt_in, &pv.inputs[1]], &stops) else {
        return why.no("Q, K or V passes through other ops than scales, head copies and repeats");
    };
    let heads = extra.clone();
    extra.extend(merge.iter().copied());
    let remove = match m.remove(cx, &extra, out) {
        Ok(r) => r,
        // The copies stay where, besides the pattern, only Shape nodes read them (the
        // dynamo exporter's Kᵀ reshape reads the repeated K's shape): a Shape is known
        // when the plan is made, so what it reads is not computed.
        Err(_) if only_shapes_read(cx, &heads, &[&m.core, &m.chain, &heads]) => {
            match m.remove(cx, &merge, out) {
                Ok(r) => r,
                Err(e) => return why.no(e),
            }
        }
        Err(e) => return why.no(e),
    };
    let mut inputs: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
    inputs.extend(m.mask.map(str::to_string));
    let add = vec![attention_node(&m, inputs, out, Some((hq, hkv)))];
    if let Err(e) = cx.facts.check(&add, out) {
        return why.no(e);
    }
    Some(Patch {
        remove,
        add,
        ..Default::default()
    })
}

/// Every reader of what the nodes `set` write is in one of `inside` or is a Shape node,
/// and none of it is a graph output.
fn only_shapes_read(cx: &Ctx, set: &[usize], inside: &[&[usize]]) -> bool {
    set.iter().all(|&j| {
        cx.node(j)
            .outputs
            .iter()
            .filter(|o| !o.is_empty())
            .all(|o| {
                !cx.needed(o)
                    && cx.consumers(o).iter().all(|c| {
                        inside.iter().any(|s| s.contains(c))
                            || matches!(cx.node(*c).op, Op::Shape { .. })
                    })
            })
    })
}

/// `v` = `Transpose [0, 2, 1, 3](Reshape(x))` with x `[B, S, H·D]` and the Reshape
/// `[B, S, H, D]` in every inference run (for `bshd`, `v` is the Reshape's output
/// itself): returns (x, H, D).
fn split_heads<'g>(cx: &Ctx<'g>, v: &str, bshd: bool) -> Option<(&'g str, usize, usize)> {
    let mut r = v;
    if !bshd {
        let (_, t) = cx.prod(v, |op| {
            *op == Op::Transpose {
                perm: Some(vec![0, 2, 1, 3]),
            }
        })?;
        r = &t.inputs[0];
    }
    let (_, reshape) = cx.prod(r, |op| matches!(op, Op::Reshape { .. }))?;
    let x = reshape.inputs[0].as_str();
    let (xs, rs) = (cx.facts.shapes(x)?, cx.facts.shapes(r)?);
    let mut hd = None;
    for (xs, rs) in xs.iter().zip(&rs) {
        let (&[b, s, hd_], &[b2, s2, h, d]) = (*xs, *rs) else {
            return None;
        };
        let ok = b == b2 && s == s2 && hd_ == h * d && hd.is_none_or(|x| x == (h, d));
        if !ok {
            return None;
        }
        hd = Some((h, d));
    }
    let (h, d) = hd?;
    Some((x, h, d))
}

/// `y` `[B, H, S, Dv]` read only by `Transpose [0, 2, 1, 3]`, read only by a Reshape to
/// `[B, S, H·Dv]` in every run: those two nodes and the merged value.
fn merged_heads<'g>(cx: &Ctx<'g>, y: &str) -> Option<(Vec<usize>, &'g str)> {
    let ti = cx.sole_consumer(y)?;
    let t = cx.node(ti);
    if t.op
        != (Op::Transpose {
            perm: Some(vec![0, 2, 1, 3]),
        })
    {
        return None;
    }
    let ri = cx.sole_consumer(&t.outputs[0])?;
    let r = cx.node(ri);
    if !matches!(r.op, Op::Reshape { .. }) || r.inputs[0] != t.outputs[0] {
        return None;
    }
    let out = r.outputs[0].as_str();
    let (ys, os) = (cx.facts.shapes(y)?, cx.facts.shapes(out)?);
    let ok = ys.iter().zip(&os).all(|(y, o)| {
        matches!((*y, *o), (&[b, h, s, dv], &[b2, s2, hdv]) if b == b2 && s == s2 && hdv == h * dv)
    });
    ok.then_some((vec![ti, ri], out))
}

/// The nodes on the paths from `starts` back to `stops`, through what may lie between a
/// head split and the MatMuls: Transpose, Reshape, Unsqueeze, Expand (their data input)
/// and scalar Mul/Div. `None` when a path meets anything else first.
fn between(cx: &Ctx, starts: &[&str], stops: &[&str]) -> Option<Vec<usize>> {
    let mut seen: Vec<usize> = vec![];
    let mut todo: Vec<&str> = starts.to_vec();
    while let Some(v) = todo.pop() {
        if stops.contains(&v) {
            continue;
        }
        let ni = cx.producer(v)?;
        if seen.contains(&ni) {
            continue;
        }
        let n = cx.node(ni);
        let data = match n.op {
            Op::Transpose { .. } | Op::Reshape { .. } | Op::Unsqueeze { .. } | Op::Expand => {
                n.inputs[0].as_str()
            }
            Op::Binary(BinaryOp::Mul | BinaryOp::Div) => scaled(cx, v)?.1,
            _ => return None,
        };
        seen.push(ni);
        todo.push(data);
    }
    Some(seen)
}

/// PyTorch's guard on a softmax whose row is masked out entirely, `Where(IsNaN(p), 0, p)`
/// (IsNaN as the importer writes it, `Equal(Equal(p, p), false)`), when those are all
/// that read `p`: Attention already gives 0 for such rows, so the guard goes into the
/// fused node. Returns the guard's nodes and its output.
pub(super) fn nan_guard<'g>(cx: &Ctx<'g>, p: &str) -> Option<(Vec<usize>, &'g str)> {
    let readers = cx.consumers(p);
    if readers.len() != 2 || cx.needed(p) {
        return None;
    }
    let equal = Op::Binary(BinaryOp::Equal);
    let (ei, eq) = readers
        .iter()
        .map(|&c| (c, cx.node(c)))
        .find(|(_, n)| n.op == equal && n.inputs.iter().all(|v| v == p))?;
    let ni = cx.sole_consumer(&eq.outputs[0])?;
    let not = cx.node(ni);
    let is_false = |v: &str| {
        cx.konst(v)
            .is_some_and(|t| t.dtype() == DType::Bool && t.numel() == 1 && t.to_f64_vec()[0] == 0.0)
    };
    let negates = not.op == equal
        && not.inputs.iter().any(|v| *v == eq.outputs[0])
        && not.inputs.iter().any(|v| is_false(v));
    let wi = cx.sole_consumer(&not.outputs[0]).filter(|_| negates)?;
    let w = cx.node(wi);
    let guards = w.op == Op::Where
        && w.inputs[0] == not.outputs[0]
        && w.inputs[2] == p
        && cx.scalar(&w.inputs[1]) == Some(0.0)
        && readers.contains(&wi)
        && !cx.needed(&eq.outputs[0])
        && !cx.needed(&not.outputs[0]);
    guards.then(|| (vec![ei, ni, wi], w.outputs[0].as_str()))
}

/// Matches the pattern anchored on Softmax `i` (see the module comment).
fn matched<'g>(cx: &Ctx<'g>, i: usize, why: &mut Why) -> Option<Match<'g>> {
    let sm = cx.node(i);
    let Op::Softmax { axis } = sm.op else {
        return None;
    };
    let z = sm.inputs[0].as_str();
    if !(axis == -1 || cx.facts.rank(z).is_some_and(|r| axis == r as i64 - 1)) {
        return why.no(format!("Softmax axis {axis} is not the last axis"));
    }
    let (guard, p) = match nan_guard(cx, &sm.outputs[0]) {
        Some((nodes, out)) => (nodes, out),
        None => (vec![], sm.outputs[0].as_str()),
    };
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
    core.extend(guard);
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
    Some(Match {
        core,
        chain: causal.clone().unwrap_or_default(),
        pv,
        q_in: scores.q_in,
        kt_in: scores.kt_in,
        q: scores.q,
        k,
        v,
        k_bshd: scores.k_bshd,
        mask,
        causal: causal.is_some(),
        scale: scores.scale,
    })
}

/// `v = x * c`, `c * x` or `x / c` with `c` a scalar constant: (node, x, multiplier).
pub(super) fn scaled<'g>(cx: &Ctx<'g>, v: &str) -> Option<(usize, &'g str, f64)> {
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
        q_in: &mm.inputs[0],
        kt_in: &mm.inputs[1],
        q,
        k,
        k_bshd,
        scale,
        nodes,
    })
}

/// `Kᵀ` as the dynamo exporter writes it for scaled_dot_product_attention: K `[B, H, S, D]`
/// reshaped to `[B·H, S, D]`, transposed with perm [0, 2, 1] and reshaped back to
/// `[B, H, D, S]`. Returns K. The reshapes must only merge and split the leading dims,
/// which is what makes the chain a plain transpose of the last two: checked on the shapes
/// of every inference run, so it holds for symbolic batch and sequence sizes too.
fn flat_transposed<'g>(cx: &Ctx<'g>, kt: &str) -> Option<&'g str> {
    let (_, r2) = cx.prod(kt, |op| matches!(op, Op::Reshape { .. }))?;
    let (_, t) = cx.prod(&r2.inputs[0], |op| {
        *op == Op::Transpose {
            perm: Some(vec![0, 2, 1]),
        }
    })?;
    let (_, r1) = cx.prod(&t.inputs[0], |op| matches!(op, Op::Reshape { .. }))?;
    let k = r1.inputs[0].as_str();
    let (ks, ms, ts) = (
        cx.facts.shapes(k)?,
        cx.facts.shapes(&r1.outputs[0])?,
        cx.facts.shapes(kt)?,
    );
    // In every inference run (so for any value of the symbols).
    let plain = ks.iter().zip(&ms).zip(&ts).all(|((k, m), t)| match k {
        [b, h, s, d] => *m == [b * h, *s, *d] && *t == [*b, *h, *d, *s],
        _ => false,
    });
    plain.then_some(k)
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
