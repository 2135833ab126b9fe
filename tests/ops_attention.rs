//! Attention and VarlenAttention against a naive float64 reference that materialises
//! the full score matrix and takes a plain softmax per row.

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::rng::Rng;
use graphrun::{BackendKind, DType, Tensor};

/// Softmax over `scores` (−inf = masked) applied to V rows; a row with nothing visible
/// gives zeros.
fn softmax_mix(scores: &[f64], v_row: impl Fn(usize) -> Vec<f64>, dv: usize) -> Vec<f64> {
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut out = vec![0.0; dv];
    if m == f64::NEG_INFINITY {
        return out;
    }
    let p: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let sum: f64 = p.iter().sum();
    for (j, pj) in p.iter().enumerate() {
        for (o, x) in out.iter_mut().zip(v_row(j)) {
            *o += pj / sum * x;
        }
    }
    out
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Naive ONNX Attention on 4-D inputs (upper-left causal, GQA).
fn ref_attention(a: &[Option<Tensor>], causal: bool, scale: Option<f64>) -> Expected {
    let (q, k, v) = (
        a[0].as_ref().unwrap(),
        a[1].as_ref().unwrap(),
        a[2].as_ref().unwrap(),
    );
    let mask = a.get(3).cloned().flatten();
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let (b, hq, sq, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (hkv, skv, dv) = (ks[1], ks[2], vs[3]);
    let (qd, kd, vd) = (q.to_f64_vec(), k.to_f64_vec(), v.to_f64_vec());
    let md = mask.as_ref().map(|m| m.to_f64_vec());
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let mut out = vec![];
    for bi in 0..b {
        for h in 0..hq {
            let g = h / (hq / hkv);
            let kv = (bi * hkv + g) * skv;
            for i in 0..sq {
                let qi = &qd[((bi * hq + h) * sq + i) * d..][..d];
                let scores: Vec<f64> = (0..skv)
                    .map(|j| {
                        let mut s = scale * dot(qi, &kd[(kv + j) * d..][..d]);
                        if causal && j > i {
                            s = f64::NEG_INFINITY;
                        }
                        if let (Some(m), Some(md)) = (&mask, &md) {
                            let x = md[bcast_offset(&[bi, h, i, j], m.shape())];
                            if m.dtype() == DType::Bool {
                                if x == 0.0 {
                                    s = f64::NEG_INFINITY;
                                }
                            } else {
                                s += x;
                            }
                        }
                        s
                    })
                    .collect();
                out.extend(softmax_mix(
                    &scores,
                    |j| vd[(kv + j) * dv..][..dv].to_vec(),
                    dv,
                ));
            }
        }
    }
    vec![(vec![b, hq, sq, dv], out)]
}

/// Naive VarlenAttention (bottom-right causal, GQA).
fn ref_varlen(a: &[Option<Tensor>], causal: bool, scale: Option<f64>) -> Expected {
    let (q, k, v) = (
        a[0].as_ref().unwrap(),
        a[1].as_ref().unwrap(),
        a[2].as_ref().unwrap(),
    );
    let cq = a[3].as_ref().unwrap().to_i64_vec();
    let ck = a[4].as_ref().unwrap().to_i64_vec();
    let (tq, hq, d) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (hkv, dv) = (k.shape()[1], v.shape()[2]);
    let (qd, kd, vd) = (q.to_f64_vec(), k.to_f64_vec(), v.to_f64_vec());
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let mut out = vec![0.0; tq * hq * dv];
    for b in 0..cq.len() - 1 {
        let (q0, q1, k0, k1) = (
            cq[b] as usize,
            cq[b + 1] as usize,
            ck[b] as usize,
            ck[b + 1] as usize,
        );
        let (lq, lk) = ((q1 - q0) as i64, (k1 - k0) as i64);
        for h in 0..hq {
            let g = h / (hq / hkv);
            for i in 0..q1 - q0 {
                let qi = &qd[((q0 + i) * hq + h) * d..][..d];
                let scores: Vec<f64> = (0..k1 - k0)
                    .map(|j| {
                        if causal && j as i64 > i as i64 + lk - lq {
                            f64::NEG_INFINITY
                        } else {
                            scale * dot(qi, &kd[((k0 + j) * hkv + g) * d..][..d])
                        }
                    })
                    .collect();
                let row = softmax_mix(
                    &scores,
                    |j| vd[((k0 + j) * hkv + g) * dv..][..dv].to_vec(),
                    dv,
                );
                out[((q0 + i) * hq + h) * dv..][..dv].copy_from_slice(&row);
            }
        }
    }
    vec![(vec![tq, hq, dv], out)]
}

fn attn_op(causal: bool, scale: Option<f64>) -> graphrun::graph::Op {
    let mut attrs = vec![("is_causal", AttrValue::Int(causal as i64))];
    if let Some(s) = scale {
        attrs.push(("scale", AttrValue::Float(s)));
    }
    op("Attention", &attrs)
}
fn varlen_op(causal: bool, scale: Option<f64>) -> graphrun::graph::Op {
    let mut attrs = vec![("is_causal", AttrValue::Int(causal as i64))];
    if let Some(s) = scale {
        attrs.push(("scale", AttrValue::Float(s)));
    }
    op("VarlenAttention", &attrs)
}

/// Q [b,hq,sq,d], K [b,hkv,skv,d], V [b,hkv,skv,dv], seeded normal data.
#[allow(clippy::too_many_arguments)]
fn qkv(
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    skv: usize,
    d: usize,
    dv: usize,
    seed: u64,
) -> Vec<Arg> {
    vec![
        inp(randn(&[b, hq, sq, d], seed)),
        inp(randn(&[b, hkv, skv, d], seed + 1)),
        inp(randn(&[b, hkv, skv, dv], seed + 2)),
    ]
}

fn check_attention(args: Vec<Arg>, causal: bool, scale: Option<f64>) {
    check(attn_op(causal, scale), &args, &FLOATS, |a| {
        ref_attention(a, causal, scale)
    });
}

/// A seeded bool mask, true with probability `p_keep`.
fn rand_bools(shape: &[usize], seed: u64, p_keep: f64) -> Vec<bool> {
    let mut r = Rng::new(seed);
    (0..shape.iter().product())
        .map(|_| r.uniform() < p_keep)
        .collect()
}

#[test]
fn attention_no_mask() {
    check_attention(qkv(2, 3, 3, 5, 7, 8, 8, 10), false, None);
}

#[test]
fn attention_long_sequences_not_block_multiples() {
    // Several key blocks and query blocks, none of them full at the end.
    check_attention(qkv(1, 2, 2, 70, 150, 16, 16, 20), false, None);
}

#[test]
fn attention_causal_square() {
    check_attention(qkv(2, 2, 2, 150, 150, 16, 16, 30), true, None);
}

#[test]
fn attention_causal_fewer_queries() {
    // Upper-left: query i sees keys 0..=i only, even though there are more keys.
    check_attention(qkv(1, 2, 2, 20, 150, 8, 8, 40), true, None);
}

#[test]
fn attention_causal_more_queries() {
    // Queries at or past Skv see every key.
    check_attention(qkv(1, 2, 2, 150, 20, 8, 8, 50), true, None);
}

#[test]
fn attention_bool_mask_2d_with_fully_masked_row() {
    let (sq, skv) = (40, 150);
    let mut m = rand_bools(&[sq, skv], 60, 0.7);
    m[3 * skv..4 * skv].fill(false); // row 3 sees nothing: output 0, not NaN
    let mut args = qkv(2, 2, 2, sq, skv, 8, 8, 61);
    args.push(inp(bools(&[sq, skv], &m)));
    check_attention(args.clone(), false, None);
    // Causal and mask combined: row 0 sees only key 0, which the mask removes.
    let mut m2 = m.clone();
    m2[0] = false;
    args[3] = inp(bools(&[sq, skv], &m2));
    check_attention(args, true, None);
}

#[test]
fn attention_bool_key_padding_mask() {
    // [B, 1, 1, Skv]: batch 0 right-padded (keys 0..33), batch 1 left-padded (keys
    // 70..90), so its first key block is wholly masked while later keys are visible.
    let (b, skv) = (2, 90);
    let m: Vec<bool> = (0..b * skv)
        .map(|x| if x < skv { x < 33 } else { x % skv >= 70 })
        .collect();
    let mut args = qkv(b, 4, 4, 17, skv, 8, 8, 70);
    args.push(inp(bools(&[b, 1, 1, skv], &m)));
    check_attention(args, false, None);
}

#[test]
fn attention_additive_mask_with_neg_inf() {
    let (b, h, sq, skv) = (2, 2, 9, 130);
    let mut r = Rng::new(80);
    let mut m: Vec<f64> = (0..b * h * sq * skv)
        .map(|_| {
            if r.uniform() < 0.2 {
                f64::NEG_INFINITY
            } else {
                r.uniform_in(-2.0, 1.0)
            }
        })
        .collect();
    m[(h * sq + 4) * skv..(h * sq + 5) * skv].fill(f64::NEG_INFINITY); // a fully masked row
    let mut args = qkv(b, h, h, sq, skv, 8, 8, 81);
    args.push(inp(f64s(&[b, h, sq, skv], &m)));
    check_attention(args, false, None);
    // Broadcast from [1, H, 1, Skv] as well.
    let m1: Vec<f64> = m[..h * skv].to_vec();
    let mut args = qkv(b, h, h, sq, skv, 8, 8, 82);
    args.push(inp(f64s(&[1, h, 1, skv], &m1)));
    check_attention(args, true, None);
}

#[test]
fn attention_gqa() {
    check_attention(qkv(2, 8, 2, 33, 100, 16, 16, 90), false, None);
    check_attention(qkv(2, 8, 2, 100, 100, 16, 16, 91), true, None);
}

#[test]
fn attention_dv_differs_and_custom_scale() {
    // 0.375 is exact in f32, the type the attribute is stored in.
    check_attention(qkv(1, 4, 2, 21, 75, 16, 24, 100), false, Some(0.375));
    check_attention(qkv(1, 2, 2, 75, 75, 12, 5, 101), true, Some(0.375));
}

#[test]
fn attention_wide_heads() {
    // Dv past one 64-wide column tile of the CPU kernel (and not a multiple of it), D
    // wider than a vector, query blocks of full and small (decoding) size.
    check_attention(qkv(1, 2, 1, 40, 70, 72, 130, 102), false, None);
    check_attention(qkv(2, 2, 2, 3, 70, 72, 65, 103), true, None);
}

/// Packed Q/K/V for sequences with the given lengths, cu_seqlens as i32.
fn varlen_args(
    lq: &[usize],
    lk: &[usize],
    hq: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    seed: u64,
) -> Vec<Arg> {
    let cu = |l: &[usize]| {
        let mut c = vec![0i32];
        for &x in l {
            c.push(c.last().unwrap() + x as i32);
        }
        c
    };
    let (cq, ck) = (cu(lq), cu(lk));
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    vec![
        inp(randn(&[tq, hq, d], seed)),
        inp(randn(&[tk, hkv, d], seed + 1)),
        inp(randn(&[tk, hkv, dv], seed + 2)),
        inp(Tensor::from_vec(&[cq.len()], cq).unwrap()),
        inp(Tensor::from_vec(&[ck.len()], ck).unwrap()),
    ]
}

fn check_varlen(args: Vec<Arg>, causal: bool, scale: Option<f64>) {
    check(varlen_op(causal, scale), &args, &FLOATS, |a| {
        ref_varlen(a, causal, scale)
    });
}

#[test]
fn varlen_three_sequences_with_an_empty_one() {
    // Tq != Tk; sequence 1 is empty; sequence 2 spans several key blocks.
    for causal in [false, true] {
        check_varlen(
            varlen_args(&[5, 0, 70], &[7, 0, 150], 2, 2, 16, 16, 110),
            causal,
            None,
        );
    }
}

#[test]
fn varlen_gqa_more_queries_than_keys() {
    // Lq > Lk, bottom-right causal: the first Lq - Lk queries see nothing (output 0);
    // a sequence with queries but no keys gives 0 too.
    for causal in [false, true] {
        check_varlen(
            varlen_args(&[9, 4, 40], &[4, 0, 40], 8, 2, 8, 12, 120),
            causal,
            Some(0.375),
        );
    }
}

#[test]
fn varlen_accepts_i64_cu_seqlens() {
    let mut args = varlen_args(&[3, 6], &[5, 2], 2, 1, 8, 8, 130);
    args[3] = inp(i64s(&[3], &[0, 3, 9]));
    args[4] = inp(i64s(&[3], &[0, 5, 7]));
    check_varlen(args, true, None);
}

#[test]
fn varlen_rejects_bad_cu_seqlens() {
    let i32s = |v: &[i32]| inp(Tensor::from_vec(&[v.len()], v.to_vec()).unwrap());
    let base = varlen_args(&[3, 4, 2], &[4, 4, 1], 2, 2, 8, 8, 140); // Tq = 9, Tk = 9
    let bad: [(usize, &[i32]); 4] = [
        (3, &[0, 5, 3, 9]),  // decreasing
        (3, &[0, 3, 7, 8]),  // last entry is not Tq
        (4, &[0, 4, 8, 12]), // runs past Tk
        (4, &[1, 4, 8, 9]),  // does not start at 0
    ];
    for (slot, cu) in bad {
        let mut args = base.clone();
        args[slot] = i32s(cu);
        let r = run_op(
            BackendKind::Cpu,
            varlen_op(false, None),
            &args,
            1,
            DType::F32,
        );
        let e = match r {
            Ok(_) => panic!("cu_seqlens {cu:?} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("node 'node'") && e.contains("cu_seqlens"),
            "unclear error: {e}"
        );
    }
}

// --- The 3-D form: Q [B, Sq, Hq·D], K [B, Skv, Hkv·D], V [B, Skv, Hkv·Dv] with
// q_num_heads / kv_num_heads, checked against the 4-D reference on the same numbers. ---

fn attn3_op(causal: bool, scale: Option<f64>, hq: usize, hkv: usize) -> graphrun::graph::Op {
    let mut attrs = vec![
        ("is_causal", AttrValue::Int(causal as i64)),
        ("q_num_heads", AttrValue::Int(hq as i64)),
        ("kv_num_heads", AttrValue::Int(hkv as i64)),
    ];
    if let Some(s) = scale {
        attrs.push(("scale", AttrValue::Float(s)));
    }
    op("Attention", &attrs)
}

fn tensor(a: &Arg) -> &Tensor {
    match a {
        Arg::In(t) | Arg::Const(t) => t,
        Arg::None => panic!("no tensor"),
    }
}

/// Runs the 4-D case `args` in the 3-D form on every backend and dtype: the reference is
/// the 4-D one on the unpacked inputs, packed.
fn check_attention_3d(args: Vec<Arg>, causal: bool, scale: Option<f64>) {
    let (hq, hkv) = (tensor(&args[0]).shape()[1], tensor(&args[1]).shape()[1]);
    let mut args3: Vec<Arg> = args[..3]
        .iter()
        .map(|a| inp(pack_heads(tensor(a))))
        .collect();
    args3.extend(args.get(3).cloned());
    check(attn3_op(causal, scale, hq, hkv), &args3, &FLOATS, |a| {
        let mut a4: Vec<Option<Tensor>> = (0..3)
            .map(|i| Some(unpack_heads(a[i].as_ref().unwrap(), [hq, hkv, hkv][i])))
            .collect();
        a4.extend(a.get(3).cloned());
        let [(shape, y)]: [_; 1] = ref_attention(&a4, causal, scale).try_into().unwrap();
        let y = pack_heads(&f64s(&shape, &y));
        vec![(y.shape().to_vec(), y.to_f64_vec())]
    });
}

#[test]
fn attention_3d_matches_4d() {
    check_attention_3d(qkv(2, 3, 3, 5, 7, 8, 8, 210), false, None);
    // Several query and key blocks, none full at the end.
    check_attention_3d(qkv(1, 2, 2, 70, 150, 16, 16, 211), false, None);
}

#[test]
fn attention_3d_causal_sq_differs_from_skv() {
    check_attention_3d(qkv(1, 2, 2, 20, 150, 8, 8, 220), true, None);
    check_attention_3d(qkv(2, 2, 2, 150, 20, 8, 8, 221), true, None);
}

#[test]
fn attention_3d_gqa_and_dv() {
    check_attention_3d(qkv(2, 8, 2, 33, 100, 16, 16, 230), true, None);
    check_attention_3d(qkv(1, 4, 2, 21, 75, 16, 24, 231), false, Some(0.375));
}

#[test]
fn attention_3d_masks() {
    let (b, h, sq, skv) = (2, 2, 40, 90);
    let mut m = rand_bools(&[sq, skv], 240, 0.7);
    m[3 * skv..4 * skv].fill(false); // a fully masked row gives 0
    let mut args = qkv(b, h, h, sq, skv, 8, 8, 241);
    args.push(inp(bools(&[sq, skv], &m)));
    check_attention_3d(args, true, None);
    // Additive, broadcast from [B, 1, 1, Skv] and full [B, Hq, Sq, Skv].
    let mut r = Rng::new(242);
    let add: Vec<f64> = (0..b * h * sq * skv)
        .map(|_| r.uniform_in(-2.0, 1.0))
        .collect();
    let mut args = qkv(b, 4, 2, sq, skv, 8, 8, 243);
    args.push(inp(f64s(&[b, 1, 1, skv], &add[..b * skv])));
    check_attention_3d(args, false, None);
    let mut args = qkv(b, h, h, sq, skv, 8, 8, 244);
    args.push(inp(f64s(&[b, h, sq, skv], &add)));
    check_attention_3d(args, false, None);
}

/// The packed form (K and V omitted, what rule `attention_qkv` makes): Q, K and V one
/// after the other on the last axis of one `[B, S, (Hq + 2·Hkv)·D]` input, on every
/// backend and dtype; the reference is the 4-D one on the parts.
fn check_attention_qkv(
    b: usize,
    hq: usize,
    hkv: usize,
    s: usize,
    d: usize,
    causal: bool,
    seed: u64,
) {
    let parts: Vec<Tensor> = qkv(b, hq, hkv, s, s, d, d, seed)
        .iter()
        .map(|a| pack_heads(tensor(a)))
        .collect();
    let x = concat_last(&[&parts[0], &parts[1], &parts[2]]);
    let args = vec![inp(x), Arg::None, Arg::None];
    check(attn3_op(causal, None, hq, hkv), &args, &FLOATS, |a| {
        let p = split_last(a[0].as_ref().unwrap(), &[hq * d, hkv * d, hkv * d]);
        let a4: Vec<Option<Tensor>> = (0..3)
            .map(|i| Some(unpack_heads(&p[i], [hq, hkv, hkv][i])))
            .collect();
        let [(shape, y)]: [_; 1] = ref_attention(&a4, causal, None).try_into().unwrap();
        let y = pack_heads(&f64s(&shape, &y));
        vec![(y.shape().to_vec(), y.to_f64_vec())]
    });
}

#[test]
fn attention_packed_qkv() {
    check_attention_qkv(2, 2, 2, 9, 8, true, 260);
    check_attention_qkv(1, 4, 2, 70, 16, false, 261);
    // K and V are omitted together; the packed width must be (Hq + 2·Hkv)·D.
    let x = randn(&[1, 3, 40], 262);
    let e = run_op(
        BackendKind::Cpu,
        attn3_op(false, None, 2, 2),
        &[inp(x.clone()), Arg::None, Arg::None],
        1,
        DType::F32,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("40 is not (q_num_heads 2 + 2 · kv_num_heads 2) · D"),
        "{e}"
    );
    let e = run_op(
        BackendKind::Cpu,
        attn3_op(false, None, 2, 2),
        &[inp(x.clone()), inp(x), Arg::None],
        1,
        DType::F32,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("given or omitted together"), "{e}");
}

/// The error of a one-node graph that should not load.
fn attention_error(op_: graphrun::graph::Op, shapes: [&[usize]; 3]) -> String {
    let args: Vec<Arg> = (0..3)
        .map(|i| inp(randn(shapes[i], 250 + i as u64)))
        .collect();
    match run_op(BackendKind::Cpu, op_, &args, 1, DType::F32) {
        Ok(_) => panic!("Attention on {shapes:?} was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn attention_3d_errors_say_what_is_wrong() {
    let plain = attn_op(false, None);
    let e = attention_error(plain, [&[2, 5, 16], &[2, 7, 16], &[2, 7, 16]]);
    assert!(
        e.contains("q_num_heads") && e.contains("kv_num_heads") && e.contains("node 'node'"),
        "{e}"
    );
    let e = attention_error(
        attn3_op(false, None, 3, 1),
        [&[2, 5, 16], &[2, 7, 16], &[2, 7, 16]],
    );
    assert!(e.contains("16 is not divisible by q_num_heads 3"), "{e}");
    let e = attention_error(
        attn3_op(false, None, 4, 3),
        [&[2, 5, 16], &[2, 7, 12], &[2, 7, 12]],
    );
    assert!(e.contains("multiple of key/value heads 3"), "{e}");
    let e = attention_error(
        attn3_op(false, None, 2, 2),
        [&[2, 5, 16], &[2, 7, 12], &[2, 7, 12]],
    );
    assert!(e.contains("head size 6") && e.contains("Q's 8"), "{e}");
    let e = attention_error(
        attn3_op(false, None, 2, 2),
        [&[2, 5, 16], &[2, 2, 7, 8], &[2, 2, 7, 8]],
    );
    assert!(e.contains("ranks 3, 4 and 4"), "{e}");
    let e = attention_error(
        attn3_op(false, None, 4, 2),
        [&[2, 2, 5, 8], &[2, 2, 7, 8], &[2, 2, 7, 8]],
    );
    assert!(
        e.contains("q_num_heads is 4") && e.contains("2 heads"),
        "{e}"
    );
    let model = |heads: &str| {
        format!(
            "graphrun: 1\nname: m\ninputs:\n  - {{name: q, dtype: f32, shape: [1, 2, 8]}}\noutputs: [y]\n\
             nodes:\n  - {{op: Attention, inputs: [q, q, q], outputs: [y], attrs: {{{heads}}}}}\n"
        )
    };
    let e = match graphrun::Model::from_str(&model("q_num_heads: 0, kv_num_heads: 1"), ".") {
        Ok(_) => panic!("0 heads were accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("'q_num_heads' must be positive"), "{e}");
    if let Err(e) = graphrun::Model::from_str(&model("q_num_heads: 2, kv_num_heads: 2"), ".") {
        panic!("{e}");
    }
}
