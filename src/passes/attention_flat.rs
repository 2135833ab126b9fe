//! Rule `attention_flat`: attention written on stacks of `[B·H, S, D]` matrices, as the
//! exporters write BLOOM's `baddbmm` attention (ALiBi):
//! Q, K and V of `[B, H, S, D]` each reshaped to `[B·H, S, D]`,
//! `MatMul(Q, Transpose[0, 2, 1](K)) · scale`, optionally `+ bias` (`[B·H, 1 | Sq, Sk]`,
//! the per-head position bias), reshaped to `[B, H, Sq, Sk]`, optionally `+ mask`,
//! `Softmax`, reshaped back to `[B·H, Sq, Sk]`, `MatMul(·, V)` and reshaped to
//! `[B, H, Sq, Dv]`. One 4-D `Attention` on the unflattened Q, K and V replaces it; the
//! bias, viewed as `[B, H, 1 | Sq, Sk]`, and the mask add up to its additive mask. Every
//! reshape must only merge or split the leading `B, H` (checked on the shapes of every
//! inference run, so for any symbol value), and every value in between must be read by
//! nothing else.

use super::attention::{nan_guard, scaled};
use super::pattern::{Ctx, Patch, Why};
use crate::graph::{BinaryOp, InitSource, Initializer, Node, Op};
use crate::tensor::Tensor;

pub(super) fn fuse_flat(cx: &Ctx, i: usize, why: &mut Why) -> Option<Patch> {
    let sm = cx.node(i);
    let Op::Softmax { axis } = sm.op else {
        return None;
    };
    let z = sm.inputs[0].as_str();
    if cx.facts.rank(z) != Some(4) || !(axis == -1 || axis == 3) {
        return None;
    }
    let (guard, p) = nan_guard(cx, &sm.outputs[0]).unwrap_or((vec![], &sm.outputs[0]));
    // P → Reshape [B·H, Sq, Sk] → MatMul(·, V) → Reshape [B, H, Sq, Dv]: the form's mark.
    let ri = cx.sole_consumer(p)?;
    let r = cx.node(ri);
    if !matches!(r.op, Op::Reshape { .. }) || r.inputs[0] != *p || !merges(cx, p, &r.outputs[0]) {
        return None;
    }
    let pvi = cx.sole_consumer(&r.outputs[0])?;
    let pv = cx.node(pvi);
    if pv.op != Op::MatMul || pv.inputs[0] != r.outputs[0] {
        return None;
    }
    // The output's readers: its Reshape back to 4-D, and Shape nodes (the TorchScript
    // exporter computes that Reshape's target from them), which read Q's stack instead.
    let o3 = pv.outputs[0].as_str();
    let is_shape = |c: usize| matches!(cx.node(c).op, Op::Shape { .. });
    let (shapes, rest): (Vec<usize>, Vec<usize>) =
        cx.consumers(o3).iter().partition(|&&c| is_shape(c));
    let [oi] = rest[..] else {
        return why.no(format!("'{o3}' is read by several nodes"));
    };
    if cx.needed(o3) {
        return why.no(format!("'{o3}' is a graph output"));
    }
    let o = cx.node(oi);
    let out = o.outputs[0].as_str();
    if !matches!(o.op, Op::Reshape { .. }) || !merges(cx, out, &pv.outputs[0]) {
        return why.no(format!(
            "'{}' is not reshaped back to [B, H, Sq, Dv]",
            pv.outputs[0]
        ));
    }
    let Some((vri, v)) = unflat(cx, &pv.inputs[1]) else {
        return why.no(format!(
            "V '{}' is not a [B, H, S, D] tensor reshaped to [B·H, S, D]",
            pv.inputs[1]
        ));
    };
    let mut core = vec![i, ri, pvi, oi];
    core.extend(guard);
    // Scores: Reshape(flat [+ bias]) [+ mask].
    let mut mask = None;
    let mut scores4 = z;
    if let Some((ai, add)) = cx.prod(z, |op| *op == Op::Binary(BinaryOp::Add)) {
        let flat = |s: &str| {
            cx.prod(s, |op| matches!(op, Op::Reshape { .. }))
                .is_some_and(|(_, n)| merges(cx, s, &n.inputs[0]))
        };
        let (s, m) = match (flat(&add.inputs[0]), flat(&add.inputs[1])) {
            (true, _) => (&add.inputs[0], &add.inputs[1]),
            (_, true) => (&add.inputs[1], &add.inputs[0]),
            _ => {
                return why.no(format!(
                    "neither side of Add '{}' is flat scores reshaped",
                    add.name
                ))
            }
        };
        core.push(ai);
        scores4 = s;
        mask = Some(m.as_str());
    }
    let Some((zri, zr)) = cx
        .prod(scores4, |op| matches!(op, Op::Reshape { .. }))
        .filter(|(_, n)| merges(cx, scores4, &n.inputs[0]))
    else {
        return why.no(format!(
            "'{scores4}' is not flat [B·H, Sq, Sk] scores reshaped"
        ));
    };
    core.push(zri);
    let mut s3 = zr.inputs[0].as_str();
    let mut bias = None;
    if let Some((ai, add)) = cx.prod(s3, |op| *op == Op::Binary(BinaryOp::Add)) {
        let qk_side = |v: &str| {
            let mut v = v;
            while let Some((_, x, _)) = scaled(cx, v) {
                v = x;
            }
            cx.prod(v, |op| *op == Op::MatMul).is_some()
        };
        let (s, b) = if qk_side(&add.inputs[0]) {
            (&add.inputs[0], &add.inputs[1])
        } else if qk_side(&add.inputs[1]) {
            (&add.inputs[1], &add.inputs[0])
        } else {
            return why.no(format!("neither side of Add '{}' is Q·Kᵀ", add.name));
        };
        core.push(ai);
        s3 = s;
        bias = Some(b.as_str());
    }
    let mut scale = 1.0;
    while let Some((ni, x, c)) = scaled(cx, s3) {
        core.push(ni);
        scale *= c;
        s3 = x;
    }
    if !(scale.is_finite() && scale != 0.0) {
        return why.no(format!("scale {scale} is not a finite non-zero number"));
    }
    let Some((mi, mm)) = cx.prod(s3, |op| *op == Op::MatMul) else {
        return why.no(format!("'{s3}' is not a MatMul(Q, Kᵀ) (times a scalar)"));
    };
    core.push(mi);
    let Some((qri, q)) = unflat(cx, &mm.inputs[0]) else {
        return why.no(format!(
            "Q '{}' is not a [B, H, S, D] tensor reshaped to [B·H, S, D]",
            mm.inputs[0]
        ));
    };
    let transposed = Op::Transpose {
        perm: Some(vec![0, 2, 1]),
    };
    let Some((ti, kri, k)) = cx
        .prod(&mm.inputs[1], |op| *op == transposed)
        .and_then(|(ti, t)| unflat(cx, &t.inputs[0]).map(|(kri, k)| (ti, kri, k)))
    else {
        return why.no(format!(
            "the right side of MatMul '{}' is not a Transpose [0, 2, 1] of K reshaped to [B·H, S, D]",
            mm.name
        ));
    };
    core.push(ti);
    // The additive mask: the bias viewed as [B, H, ., Sk] (its leading B·H split as Q's
    // is), plus the mask.
    let mut add = vec![];
    let fresh = |what: &str| cx.fresh_value(&format!("{}_{what}", pv.name));
    let node = |what: &str, op: Op, inputs: Vec<String>, output: &str| Node {
        name: cx.fresh_node(&format!("{}_{what}", pv.name)),
        op,
        inputs,
        outputs: vec![output.to_string()],
        loc: pv.loc.clone(),
    };
    // [B·H, a, Sk] → Unsqueeze → [1, B·H, a, Sk] → Reshape [-1, H, 0, 0] → [B, H, a, Sk]
    // (0 copies the axis in place): H the same in every run, as the heads are.
    let mut inits = vec![];
    let bias4 = match bias {
        None => None,
        Some(b) => {
            let heads = cx.facts.shapes(q).and_then(|s| {
                let h = s.first()?.get(1).copied()?;
                s.iter().all(|x| x.get(1) == Some(&h)).then_some(h)
            });
            let Some(h) = heads else {
                return why.no(format!("Q '{q}' has no one head count in every run"));
            };
            let (b1, b4) = (fresh("bias1"), fresh("bias"));
            let shape = fresh("bias_shape");
            inits.push(Initializer {
                name: shape.clone(),
                tensor: Tensor::from_vec(&[4], vec![-1i64, h as i64, 0, 0])
                    .expect("4 values for shape [4]"),
                trainable: false,
                source: InitSource::Data,
                loc: pv.loc.clone(),
            });
            let unsq = Op::Unsqueeze {
                axes: Some(vec![0]),
            };
            add.push(node("bias1", unsq, vec![b.to_string()], &b1));
            let reshape = Op::Reshape { allowzero: false };
            add.push(node("bias", reshape, vec![b1, shape], &b4));
            Some(b4)
        }
    };
    let full = match (bias4, mask) {
        (Some(b), Some(m)) => {
            let sum = fresh("mask");
            let op = Op::Binary(BinaryOp::Add);
            add.push(node("mask", op, vec![b, m.to_string()], &sum));
            Some(sum)
        }
        (Some(b), None) => Some(b),
        (None, m) => m.map(str::to_string),
    };
    let mut inputs = vec![q.to_string(), k.to_string(), v.to_string()];
    inputs.extend(full);
    add.push(Node {
        name: pv.name.clone(),
        op: Op::Attention {
            is_causal: false,
            scale: Some(scale as f32),
            q_num_heads: None,
            kv_num_heads: None,
        },
        inputs,
        outputs: vec![out.to_string()],
        loc: pv.loc.clone(),
    });
    if let Err(e) = cx.facts.check_with(&add, &inits, out) {
        return why.no(e);
    }
    // Shape(output) is Shape(Q's stack) when Dv = D, in every run: those readers move to
    // it, and Q's Reshape stays.
    let mut rewire = vec![];
    let mut stacks = vec![kri, vri];
    if shapes.is_empty() {
        stacks.push(qri);
    } else if cx.facts.same_shape(o3, &mm.inputs[0]) {
        rewire.push((o3.to_string(), mm.inputs[0].clone()));
    } else {
        return why.no(format!(
            "'{o3}' is read by Shape nodes and has another shape than Q's stack"
        ));
    }
    // The reshapes of K and V (and Q) go too where nothing else reads them; the output's
    // Shape readers are rewired, so they do not hold it.
    let swallowed =
        |set: &[usize]| cx.swallow_ok_but(set, out, |o, c| o == o3 && shapes.contains(&c));
    let mut all = core.clone();
    all.extend(stacks);
    let remove = match swallowed(&all) {
        Ok(()) => all,
        Err(_) => match swallowed(&core) {
            Ok(()) => core,
            Err(e) => return why.no(e),
        },
    };
    Some(Patch {
        remove,
        add,
        inits,
        rewire,
        ..Default::default()
    })
}

/// `flat` is `full` `[B, H, a, b]` with its two leading axes merged (`[B·H, a, b]`), in
/// every inference run.
fn merges(cx: &Ctx, full: &str, flat: &str) -> bool {
    let (Some(fs), Some(ls)) = (cx.facts.shapes(full), cx.facts.shapes(flat)) else {
        return false;
    };
    fs.iter().zip(&ls).all(|(f, l)| match (*f, *l) {
        (&[b, h, x, y], &[bh, x2, y2]) => b * h == bh && x == x2 && y == y2,
        _ => false,
    })
}

/// `v` = `Reshape(x)` merging the leading axes of a `[B, H, S, D]` x: (the Reshape, x).
fn unflat<'g>(cx: &Ctx<'g>, v: &str) -> Option<(usize, &'g str)> {
    let (ri, r) = cx.prod(v, |op| matches!(op, Op::Reshape { .. }))?;
    let x = r.inputs[0].as_str();
    merges(cx, x, v).then_some((ri, x))
}
