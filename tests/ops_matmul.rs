//! MatMul, Gemm and FusedMatMul against naive float64 references.

mod common;
use common::*;
use graphrun::graph::op::AttrValue;
use graphrun::{DType, Tensor};

/// numpy `matmul` in plain loops: 1-D operands promoted and squeezed, batch dims broadcast.
fn ref_matmul(a: &Tensor, b: &Tensor) -> (Vec<usize>, Vec<f64>) {
    let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
    let sa: Vec<usize> = if a.shape().len() == 1 {
        vec![1, a.shape()[0]]
    } else {
        a.shape().to_vec()
    };
    let sb: Vec<usize> = if b.shape().len() == 1 {
        vec![b.shape()[0], 1]
    } else {
        b.shape().to_vec()
    };
    let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    assert_eq!(k, sb[sb.len() - 2]);
    let (ba, bb) = (&sa[..sa.len() - 2], &sb[..sb.len() - 2]);
    let r = ba.len().max(bb.len());
    let dim = |s: &[usize], i: usize| {
        if i + s.len() >= r {
            s[i + s.len() - r]
        } else {
            1
        }
    };
    let batch: Vec<usize> = (0..r).map(|i| dim(ba, i).max(dim(bb, i))).collect();
    let mut out = vec![];
    for bi in indices(&batch) {
        let (ao, bo) = (bcast_offset(&bi, ba) * m * k, bcast_offset(&bi, bb) * k * n);
        for i in 0..m {
            for j in 0..n {
                out.push(
                    (0..k)
                        .map(|p| av[ao + i * k + p] * bv[bo + p * n + j])
                        .sum(),
                );
            }
        }
    }
    let mut shape = batch;
    if a.shape().len() > 1 {
        shape.push(m);
    }
    if b.shape().len() > 1 {
        shape.push(n);
    }
    (shape, out)
}

/// A copy of `t` with its last two dims swapped.
fn swap_last(t: &Tensor) -> Tensor {
    let s = t.shape();
    let r = s.len();
    let mut ts = s.to_vec();
    ts.swap(r - 1, r - 2);
    let v = t.to_f64_vec();
    let st = strides(s);
    let out: Vec<f64> = indices(&ts)
        .iter()
        .map(|i| {
            let mut j = i.clone();
            j.swap(r - 1, r - 2);
            j.iter().zip(&st).map(|(a, b)| a * b).sum::<usize>()
        })
        .map(|f| v[f])
        .collect();
    Tensor::from_vec(&ts, out).unwrap()
}

fn arg(a: &[Option<Tensor>], i: usize) -> &Tensor {
    a[i].as_ref().unwrap()
}

fn check_matmul(sa: &[usize], sb: &[usize], seed: u64) {
    let args = [
        inp(rand(sa, seed, -1.0, 1.0)),
        inp(rand(sb, seed + 1, -1.0, 1.0)),
    ];
    check(op("MatMul", &[]), &args, &FLOATS, |a| {
        vec![ref_matmul(arg(a, 0), arg(a, 1))]
    });
}

#[test]
fn matmul_2d() {
    check_matmul(&[3, 4], &[4, 5], 1);
    check_matmul(&[7, 13], &[13, 9], 2);
    check_matmul(&[1, 1], &[1, 1], 3);
}

#[test]
fn matmul_1d_operands() {
    check_matmul(&[5], &[5, 3], 4);
    check_matmul(&[3, 5], &[5], 5);
    check_matmul(&[5], &[5], 6);
    check_matmul(&[4], &[2, 4, 3], 7);
    check_matmul(&[2, 3, 4], &[4], 8);
}

#[test]
fn matmul_batched_broadcast() {
    check_matmul(&[2, 1, 3, 4], &[5, 4, 6], 9);
    check_matmul(&[8, 3, 4], &[8, 4, 5], 10);
    check_matmul(&[3, 5, 7], &[7, 9], 11); // shared B: folded into one tall product
    check_matmul(&[2, 3, 5, 7], &[1, 7, 9], 12);
    check_matmul(&[5, 7], &[3, 7, 2], 13); // broadcast A
}

#[test]
fn matmul_large_and_empty() {
    check_matmul(&[128, 200], &[200, 96], 14);
    check_matmul(&[4, 64, 100], &[100, 80], 15);
    check_matmul(&[3, 0], &[0, 4], 16);
}

/// ONNX Gemm in plain loops.
fn ref_gemm(
    a: &[Option<Tensor>],
    alpha: f64,
    beta: f64,
    ta: bool,
    tb: bool,
) -> (Vec<usize>, Vec<f64>) {
    let (av, bv) = (arg(a, 0).to_f64_vec(), arg(a, 1).to_f64_vec());
    let (sa, sb) = (arg(a, 0).shape(), arg(a, 1).shape());
    let (m, k) = if ta { (sa[1], sa[0]) } else { (sa[0], sa[1]) };
    let n = if tb { sb[0] } else { sb[1] };
    let mut out = vec![];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0;
            for p in 0..k {
                let x = if ta { av[p * m + i] } else { av[i * k + p] };
                let y = if tb { bv[j * k + p] } else { bv[p * n + j] };
                s += x * y;
            }
            let c = a
                .get(2)
                .cloned()
                .flatten()
                .map(|c| c.to_f64_vec()[bcast_offset(&[i, j], c.shape())])
                .unwrap_or(0.0);
            out.push(alpha * s + beta * c);
        }
    }
    (vec![m, n], out)
}

#[test]
fn gemm_transposes_alpha_beta_and_c() {
    let (m, k, n) = (5, 7, 6);
    let mut seed = 20;
    for ta in [false, true] {
        for tb in [false, true] {
            let sa = if ta { [k, m] } else { [m, k] };
            let sb = if tb { [n, k] } else { [k, n] };
            for c in [
                None,
                Some(vec![n]),
                Some(vec![m, 1]),
                Some(vec![]),
                Some(vec![m, n]),
            ] {
                let (alpha, beta) = (0.75, -1.5);
                seed += 3;
                let mut args = vec![
                    inp(rand(&sa, seed, -1.0, 1.0)),
                    inp(rand(&sb, seed + 1, -1.0, 1.0)),
                ];
                if let Some(c) = &c {
                    args.push(inp(rand(c, seed + 2, -1.0, 1.0)));
                }
                let attrs = [
                    ("alpha", AttrValue::Float(alpha)),
                    ("beta", AttrValue::Float(beta)),
                    ("transA", AttrValue::Int(ta as i64)),
                    ("transB", AttrValue::Int(tb as i64)),
                ];
                check(op("Gemm", &attrs), &args, &FLOATS, |a| {
                    vec![ref_gemm(a, alpha, beta, ta, tb)]
                });
            }
        }
    }
    // Defaults (alpha = beta = 1) on a size big enough for gemm's threads.
    let args = [
        inp(rand(&[96, 130], 1, -1.0, 1.0)),
        inp(rand(&[130, 70], 2, -1.0, 1.0)),
        inp(rand(&[70], 3, -1.0, 1.0)),
    ];
    check(op("Gemm", &[]), &args, &FLOATS, |a| {
        vec![ref_gemm(a, 1.0, 1.0, false, false)]
    });
}

fn act_ref(name: &str, x: f64) -> f64 {
    match name {
        "none" => x,
        "relu" => x.max(0.0),
        "gelu" => 0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt())),
        "gelu_tanh" => {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        }
        "silu" => x / (1.0 + (-x).exp()),
        "sigmoid" => 1.0 / (1.0 + (-x).exp()),
        "tanh" => x.tanh(),
        "relu6" => x.clamp(0.0, 6.0),
        _ => unreachable!(),
    }
}

/// act(A @ op(B) + bias) + residual, from the naive matmul.
fn ref_fused(a: &[Option<Tensor>], act: &str, trans_b: bool) -> (Vec<usize>, Vec<f64>) {
    let b = if trans_b {
        swap_last(arg(a, 1))
    } else {
        arg(a, 1).clone()
    };
    let (shape, mut out) = ref_matmul(arg(a, 0), &b);
    let n = *shape.last().unwrap();
    let bias = a.get(2).cloned().flatten().map(|t| t.to_f64_vec());
    let res = a
        .get(3)
        .cloned()
        .flatten()
        .map(|t| (t.shape().to_vec(), t.to_f64_vec()));
    for (f, idx) in indices(&shape).iter().enumerate() {
        let mut v = out[f] + bias.as_ref().map(|b| b[f % n]).unwrap_or(0.0);
        v = act_ref(act, v);
        if let Some((rs, rv)) = &res {
            v += rv[bcast_offset(idx, rs)];
        }
        out[f] = v;
    }
    (shape, out)
}

#[test]
fn fused_matmul_activations_bias_residual() {
    let (m, k, n) = (6, 9, 5);
    let mut seed = 100;
    for act in [
        "none",
        "relu",
        "gelu",
        "gelu_tanh",
        "silu",
        "sigmoid",
        "tanh",
        "relu6",
    ] {
        for trans_b in [false, true] {
            for (bias, res) in [(false, false), (true, false), (false, true), (true, true)] {
                seed += 4;
                let sb = if trans_b { [n, k] } else { [k, n] };
                let mut args = vec![
                    inp(rand(&[2, m, k], seed, -1.5, 1.5)),
                    inp(rand(&sb, seed + 1, -1.0, 1.0)),
                ];
                args.push(if bias {
                    inp(rand(&[n], seed + 2, -1.0, 1.0))
                } else {
                    Arg::None
                });
                if res {
                    args.push(inp(rand(&[2, m, n], seed + 3, -1.0, 1.0)));
                }
                let attrs = [
                    ("activation", AttrValue::Str(act.into())),
                    ("trans_b", AttrValue::Int(trans_b as i64)),
                ];
                check(op("FusedMatMul", &attrs), &args, &FLOATS, |a| {
                    vec![ref_fused(a, act, trans_b)]
                });
            }
        }
    }
}

#[test]
fn fused_matmul_batched_and_broadcast_residual() {
    let gelu = || {
        op(
            "FusedMatMul",
            &[
                ("activation", AttrValue::Str("gelu".into())),
                ("trans_b", AttrValue::Int(1)),
            ],
        )
    };
    // Batched B, transposed; residual broadcast from [M, 1] and from [N].
    for (i, res) in [vec![4, 1], vec![6], vec![3, 1, 6]].into_iter().enumerate() {
        let s = 200 + 10 * i as u64;
        let args = [
            inp(rand(&[2, 3, 4, 5], s, -1.0, 1.0)),
            inp(rand(&[3, 6, 5], s + 1, -1.0, 1.0)),
            inp(rand(&[6], s + 2, -1.0, 1.0)),
            inp(rand(&res, s + 3, -1.0, 1.0)),
        ];
        check(gelu(), &args, &FLOATS, |a| vec![ref_fused(a, "gelu", true)]);
    }
    // Large enough for gemm's threads and a parallel epilogue.
    let silu = op(
        "FusedMatMul",
        &[("activation", AttrValue::Str("silu".into()))],
    );
    let args = [
        inp(rand(&[2, 64, 120], 300, -1.0, 1.0)),
        inp(rand(&[120, 90], 301, -1.0, 1.0)),
        inp(rand(&[90], 302, -1.0, 1.0)),
        inp(rand(&[2, 64, 90], 303, -1.0, 1.0)),
    ];
    check(silu, &args, &FLOATS, |a| vec![ref_fused(a, "silu", false)]);
}

#[test]
fn gemm_rate_is_measurable() {
    let g = graphrun::backends::cpu::gemm_f32_gflops(64, 3);
    assert!(g.is_finite() && g > 0.0, "{g}");
}

#[test]
fn products_with_a_long_reduction() {
    // K = 70000: WebGPU sums K in dispatches of 32768 (lavapipe ends a shader loop after
    // 65535 iterations), the partial sums in the output and the epilogue with the last.
    let k = 70000;
    let args = [
        inp(rand(&[2, 3, k], 400, -1.0, 1.0)),
        inp(rand(&[k, 4], 401, -1.0, 1.0)),
    ];
    check(op("MatMul", &[]), &args, &[DType::F32], |a| {
        vec![ref_fused(a, "none", false)]
    });
    // With an epilogue, split in two (a K of 40000 keeps f32's rounding of the sum
    // within the tolerance).
    let k = 40000;
    for (act, trans_b) in [("relu", false), ("gelu", true)] {
        let sb = if trans_b { [4, k] } else { [k, 4] };
        let args = [
            inp(rand(&[2, 3, k], 402, -1.0, 1.0)),
            inp(rand(&sb, 403, -1.0, 1.0)),
            inp(rand(&[4], 404, -1.0, 1.0)),
            inp(rand(&[2, 3, 4], 405, -1.0, 1.0)),
        ];
        let attrs = [
            ("activation", AttrValue::Str(act.into())),
            ("trans_b", AttrValue::Int(trans_b as i64)),
        ];
        check(op("FusedMatMul", &attrs), &args, &[DType::F32], |a| {
            vec![ref_fused(a, act, trans_b)]
        });
    }
}
