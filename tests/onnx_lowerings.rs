//! The ONNX operators the importer writes as compositions of graphrun's ops
//! (src/onnx/nodes/composite.rs): each one-node model runs on every backend, in f32 and
//! (where the backend computes it) f64, against a float64 reference written here, under
//! several attribute settings; the differentiable ones also have their gradients checked
//! against central finite differences of the reference.

mod common;
#[path = "common/onnx_case.rs"]
mod onnx_case;
#[path = "common/onnx_model.rs"]
mod onnx_model;

use common::*;
use graphrun::onnx::proto::AttributeProto;
use graphrun::{BackendKind, DType, Session, SessionOptions, Tensor};
use onnx_case::*;
use onnx_model::*;
use std::collections::HashMap;

// ---- Size ---------------------------------------------------------------------------------

#[test]
fn size_counts_elements_of_shapes_known_only_at_run_time() {
    let n = node("Size", "", &["x"], &["y"], vec![]);
    for rank in [0usize, 1, 3] {
        let dims = vec![None; rank];
        let g =
            import_one_node(n.clone(), 13, vec![input("x", DType::F32, &dims)], vec![]).unwrap();
        let shapes: Vec<Vec<usize>> = match rank {
            0 => vec![vec![]],
            1 => vec![vec![5], vec![0], vec![1]],
            _ => vec![vec![2, 3, 4], vec![1, 7, 1], vec![3, 0, 2]],
        };
        for backend in backends() {
            let opts = SessionOptions {
                backend,
                ..SessionOptions::unfused()
            };
            let mut s = Session::new(g.clone(), opts).unwrap();
            for shape in &shapes {
                let x = rand(shape, 1, -1.0, 1.0).cast(DType::F32);
                let got = s
                    .run(&HashMap::from([("x".to_string(), x)]))
                    .unwrap_or_else(|e| panic!("Size of {shape:?} on {backend:?}: {e}"));
                let y = &got[0].1;
                assert_eq!((y.dtype(), y.shape()), (DType::I64, &[][..]));
                let want = shape.iter().product::<usize>() as i64;
                assert_eq!(
                    y.to_i64_vec(),
                    vec![want],
                    "Size of {shape:?} on {backend:?}"
                );
            }
        }
    }
}

// ---- NegativeLogLikelihoodLoss ------------------------------------------------------------

/// -x[n, t, d..]·w[t] (w = 1 when absent), 0 where t = ignore; mean divides by the sum of
/// the weights of the targets not ignored.
fn nll_ref(
    x: &[f64],
    shape: &[usize],
    t: &[i64],
    w: Option<&[f64]>,
    reduction: &str,
    ignore: Option<i64>,
) -> (Vec<usize>, Vec<f64>) {
    let (n, c) = (shape[0], shape[1]);
    let d: usize = shape[2..].iter().product();
    let (mut loss, mut wsum) = (vec![], 0.0);
    for i in 0..n {
        for k in 0..d {
            let tg = t[i * d + k];
            if Some(tg) == ignore {
                loss.push(0.0);
                continue;
            }
            let wt = w.map_or(1.0, |w| w[tg as usize]);
            loss.push(-x[(i * c + tg as usize) * d + k] * wt);
            wsum += wt;
        }
    }
    let total: f64 = loss.iter().sum();
    match reduction {
        "none" => {
            let s: Vec<usize> = [shape[0]]
                .into_iter()
                .chain(shape[2..].iter().copied())
                .collect();
            (s, loss)
        }
        "sum" => (vec![], vec![total]),
        _ => (vec![], vec![total / wsum]),
    }
}

/// An NLL case and its settings.
struct Nll {
    case: Case,
    shape: Vec<usize>,
    reduction: String,
    weighted: bool,
    ignore: Option<i64>,
}

fn nll_cases() -> Vec<Nll> {
    let mut out = vec![];
    let mut seed = 0;
    for shape in [vec![4usize, 5], vec![2, 4, 3, 2]] {
        for reduction in ["none", "sum", "mean"] {
            for (weighted, ignore) in [
                (false, None),
                (true, None),
                (false, Some(1)),
                (true, Some(-1)),
                (true, Some(10)),
            ] {
                seed += 1;
                let c = shape[1];
                let tshape: Vec<usize> = [shape[0]]
                    .into_iter()
                    .chain(shape[2..].iter().copied())
                    .collect();
                let mut t = rand_ints(&tshape, seed, 0, c as i64).to_i64_vec();
                if let Some(ii) = ignore {
                    // Some targets ignored, not all.
                    for v in t.iter_mut().step_by(3) {
                        *v = ii;
                    }
                }
                // Log-probabilities: one sign, so that a sum has no cancellation.
                let x = rand(&shape, 100 + seed, -3.0, -0.1);
                let w = rand(&[c], 200 + seed, 0.2, 2.0);
                let mut attrs = vec![str_attr("reduction", reduction)];
                if let Some(ii) = ignore {
                    attrs.push(int_attr("ignore_index", ii));
                }
                let case = Case::new(
                    "NegativeLogLikelihoodLoss",
                    13,
                    vec![
                        ("x", Some(x)),
                        ("target", Some(i64s(&tshape, &t))),
                        (if weighted { "w" } else { "" }, weighted.then_some(w)),
                    ],
                )
                .with(attrs);
                out.push(Nll {
                    case,
                    shape: shape.clone(),
                    reduction: reduction.to_string(),
                    weighted,
                    ignore,
                });
            }
        }
    }
    out
}

fn nll_reference<'a>(
    shape: &'a [usize],
    reduction: &str,
    weighted: bool,
    ignore: Option<i64>,
) -> impl Fn(&[Vec<f64>]) -> Expected + 'a {
    let reduction = reduction.to_string();
    move |v: &[Vec<f64>]| {
        let t: Vec<i64> = v[1].iter().map(|&x| x as i64).collect();
        let w = weighted.then_some(&v[2][..]);
        vec![nll_ref(&v[0], shape, &t, w, &reduction, ignore)]
    }
}

#[test]
fn negative_log_likelihood_loss_on_every_backend() {
    for Nll {
        case,
        shape,
        reduction,
        weighted,
        ignore,
    } in nll_cases()
    {
        let what = format!("NLL {shape:?} {reduction} weighted {weighted} ignore {ignore:?}");
        check_case(
            &what,
            &case,
            &BOTH,
            1e-5,
            nll_reference(&shape, &reduction, weighted, ignore),
        );
    }
}

#[test]
fn negative_log_likelihood_loss_has_gradients() {
    for (k, c) in nll_cases().into_iter().enumerate() {
        let (case, shape, reduction) = (c.case, c.shape, c.reduction);
        let (weighted, ignore) = (c.weighted, c.ignore);
        let what = format!("NLL {shape:?} {reduction} weighted {weighted} ignore {ignore:?}");
        let wrt: &[usize] = if weighted { &[0, 2] } else { &[0] };
        check_grads(
            &what,
            &case,
            wrt,
            k as u64,
            nll_reference(&shape, &reduction, weighted, ignore),
        );
    }
}

// ---- RMS normalizations -------------------------------------------------------------------

/// x / sqrt(mean(x², axes axis..) + eps) · scale (scale of shape x.shape[axis..]), and
/// 1 / sqrt(..) per row (shape x.shape with the normalized dims 1).
fn rms_ref(x: &[f64], shape: &[usize], axis: usize, scale: &[f64], eps: f64) -> Expected {
    let block: usize = shape[axis..].iter().product();
    let (mut y, mut inv) = (vec![], vec![]);
    for row in x.chunks(block) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / block as f64;
        let r = 1.0 / (ms + eps).sqrt();
        y.extend(row.iter().zip(scale).map(|(v, s)| v * r * s));
        inv.push(r);
    }
    let kept: Vec<usize> = (0..shape.len())
        .map(|d| if d < axis { shape[d] } else { 1 })
        .collect();
    vec![(shape.to_vec(), y), (kept, inv)]
}

/// RMSNormalization cases: (case, shape, axis as a non-negative index, epsilon).
fn rms_cases(stash: i64) -> Vec<(Case, Vec<usize>, usize, f64)> {
    let mut out = vec![];
    for (k, (shape, axis, eps)) in [
        (vec![2usize, 3, 4], -1i64, 1e-5f32),
        (vec![2, 3, 4], 1, 0.1),
        (vec![2, 3, 4], 0, 1e-5),
        (vec![3, 2, 2, 5], -2, 1e-3),
    ]
    .into_iter()
    .enumerate()
    {
        let r = shape.len() as i64;
        let a = if axis < 0 { axis + r } else { axis } as usize;
        let x = randn(&shape, 10 + k as u64);
        let scale = rand(&shape[a..], 20 + k as u64, 0.5, 1.5);
        let case = Case::new(
            "RMSNormalization",
            23,
            vec![("x", Some(x)), ("scale", Some(scale))],
        )
        .with(vec![
            int_attr("axis", axis),
            float_attr("epsilon", eps),
            int_attr("stash_type", stash),
        ]);
        out.push((case, shape, a, eps as f64));
    }
    out
}

#[test]
fn rms_normalization_on_every_backend() {
    // stash_type 1 computes in f32 (an f64 input included, as ONNX defines it); 11 in f64.
    for (stash, dtypes) in [(1, &[DType::F32][..]), (11, &[DType::F64][..])] {
        for (case, shape, axis, eps) in rms_cases(stash) {
            let what = format!("RMSNormalization {shape:?} axis {axis} stash {stash}");
            check_case(&what, &case, dtypes, 1e-5, |v| {
                rms_ref(&v[0], &shape, axis, &v[1], eps)[..1].to_vec()
            });
        }
    }
}

#[test]
fn rms_normalization_has_gradients() {
    for (k, (case, shape, axis, eps)) in rms_cases(11).into_iter().enumerate() {
        let what = format!("RMSNormalization {shape:?} axis {axis}");
        check_grads(&what, &case, &[0, 1], k as u64, |v| {
            rms_ref(&v[0], &shape, axis, &v[1], eps)[..1].to_vec()
        });
    }
}

#[test]
fn simplified_layer_normalization_in_both_domains() {
    let shape = [2usize, 3, 6];
    let x = randn(&shape, 5);
    let scale = rand(&[6], 6, 0.5, 1.5);
    for domain in ["", "com.microsoft"] {
        let mut case = Case::new(
            "SimplifiedLayerNormalization",
            17,
            vec![("x", Some(x.clone())), ("scale", Some(scale.clone()))],
        )
        .with(vec![float_attr("epsilon", 1e-3)]);
        case.domain = domain;
        case.outputs = vec!["y", "inv_std_var"];
        check_case(
            &format!("SimplifiedLayerNormalization in '{domain}'"),
            &case,
            &[DType::F32],
            1e-5,
            |v| rms_ref(&v[0], &shape, 2, &v[1], 1e-3),
        );
    }
}

#[test]
fn skip_simplified_layer_normalization() {
    let shape = [2usize, 3, 8];
    let (x, skip) = (randn(&shape, 7), randn(&shape, 8));
    let gamma = rand(&[8], 9, 0.5, 1.5);
    let bias = randn(&[8], 10);
    for with_bias in [false, true] {
        for outputs in [
            vec!["y"],
            vec!["y", "", "inv", "sum"],
            vec!["y", "", "", "sum"],
        ] {
            let mut case = Case::new(
                "SkipSimplifiedLayerNormalization",
                17,
                vec![
                    ("x", Some(x.clone())),
                    ("skip", Some(skip.clone())),
                    ("gamma", Some(gamma.clone())),
                    (
                        if with_bias { "bias" } else { "" },
                        with_bias.then(|| bias.clone()),
                    ),
                ],
            )
            .with(vec![float_attr("epsilon", 1e-6)]);
            case.domain = "com.microsoft";
            case.outputs = outputs.clone();
            let what = format!("SkipSimplifiedLayerNormalization bias {with_bias} {outputs:?}");
            check_case(&what, &case, &[DType::F32], 1e-5, |v| {
                let s: Vec<f64> = (0..v[0].len())
                    .map(|i| v[0][i] + v[1][i] + if with_bias { v[3][i % 8] } else { 0.0 })
                    .collect();
                let mut r = rms_ref(&s, &shape, 2, &v[2], 1e-6);
                r.push((shape.to_vec(), s));
                outputs
                    .iter()
                    .zip([0, 9, 1, 2])
                    .filter(|(o, _)| !o.is_empty())
                    .map(|(_, k)| r[k].clone())
                    .collect()
            });
        }
    }
}

/// ONNX Runtime's SkipLayerNormalization: s = x + skip (+ bias) normalized over the last
/// axis, · gamma (+ beta); the mean, inv_std_var and the sum on request. A skip of x's shape
/// is fused back into one AddLayerNormalization, a broadcast one ([S, H]) stays an Add.
#[test]
fn skip_layer_normalization() {
    let shape = [2usize, 3, 8];
    let x = randn(&shape, 11);
    let gamma = rand(&[8], 12, 0.5, 1.5);
    let (beta, bias) = (randn(&[8], 13), randn(&[8], 14));
    for skip_shape in [vec![2usize, 3, 8], vec![3, 8]] {
        let skip = randn(&skip_shape, 15);
        let n_skip = skip.numel();
        for (with_beta, with_bias) in [(false, false), (true, false), (true, true)] {
            for outputs in [
                vec!["y"],
                vec!["y", "mean", "inv", "sum"],
                vec!["y", "", "", "sum"],
            ] {
                let opt = |on: bool, name: &'static str, v: &Tensor| match on {
                    true => (name, Some(v.clone())),
                    false => ("", None),
                };
                let mut case = Case::new(
                    "SkipLayerNormalization",
                    17,
                    vec![
                        ("x", Some(x.clone())),
                        ("skip", Some(skip.clone())),
                        ("gamma", Some(gamma.clone())),
                        opt(with_beta, "beta", &beta),
                        opt(with_bias, "bias", &bias),
                    ],
                )
                .with(vec![float_attr("epsilon", 1e-5)]);
                case.domain = "com.microsoft";
                case.outputs = outputs.clone();
                let what = format!(
                    "SkipLayerNormalization skip {skip_shape:?} beta {with_beta} bias {with_bias} {outputs:?}"
                );
                check_case(&what, &case, &[DType::F32], 1e-5, |v| {
                    // Inputs keep their slots: beta is 3, bias 4 (empty when omitted).
                    let at = |k: usize, j: usize| v[k].get(j).copied().unwrap_or(0.0);
                    let s: Vec<f64> = (0..v[0].len())
                        .map(|i| v[0][i] + v[1][i % n_skip] + at(4, i % 8))
                        .collect();
                    let (mut y, mut mean, mut inv) = (vec![], vec![], vec![]);
                    for row in s.chunks(8) {
                        let m = row.iter().sum::<f64>() / 8.0;
                        let var = row.iter().map(|e| (e - m) * (e - m)).sum::<f64>() / 8.0;
                        let r = 1.0 / (var + 1e-5).sqrt();
                        y.extend(
                            row.iter()
                                .enumerate()
                                .map(|(j, e)| (e - m) * r * v[2][j] + at(3, j)),
                        );
                        mean.push(m);
                        inv.push(r);
                    }
                    let r = [
                        (shape.to_vec(), y),
                        (vec![2, 3, 1], mean),
                        (vec![2, 3, 1], inv),
                        (shape.to_vec(), s),
                    ];
                    outputs
                        .iter()
                        .zip(r)
                        .filter(|(o, _)| !o.is_empty())
                        .map(|(_, r)| r)
                        .collect()
                });
            }
        }
    }
}

// ---- LpNormalization, MeanVarianceNormalization, Shrink -----------------------------------

fn lp_ref(x: &[f64], shape: &[usize], axis: usize, p: i64) -> Expected {
    let mut y = vec![0.0; x.len()];
    for lane in groups(shape, &[axis]) {
        let norm = if p == 1 {
            lane.iter().map(|&i| x[i].abs()).sum::<f64>()
        } else {
            lane.iter().map(|&i| x[i] * x[i]).sum::<f64>().sqrt()
        };
        for &i in &lane {
            y[i] = if norm == 0.0 { 0.0 } else { x[i] / norm };
        }
    }
    vec![(shape.to_vec(), y)]
}

#[test]
fn lp_normalization_on_every_backend_with_gradients() {
    let shape = [3usize, 4, 5];
    for (k, (axis, p)) in [(-1i64, 2i64), (1, 1), (0, 2), (2, 1)]
        .into_iter()
        .enumerate()
    {
        let a = axis.rem_euclid(3) as usize;
        let mut xv = randn(&shape, 30 + k as u64).to_f64_vec();
        let case = |xv: &[f64]| {
            Case::new("LpNormalization", 13, vec![("x", Some(f64s(&shape, xv)))])
                .with(vec![int_attr("axis", axis), int_attr("p", p)])
        };
        let what = format!("LpNormalization axis {axis} p {p}");
        check_grads(&what, &case(&xv), &[0], k as u64, |v| {
            lp_ref(&v[0], &shape, a, p)
        });
        // A lane of zeros normalizes to zeros.
        for &i in &groups(&shape, &[a])[1] {
            xv[i] = 0.0;
        }
        check_case(&what, &case(&xv), &BOTH, 1e-5, |v| {
            lp_ref(&v[0], &shape, a, p)
        });
    }
}

fn mvn_ref(x: &[f64], shape: &[usize], axes: &[usize]) -> Expected {
    let mut y = vec![0.0; x.len()];
    for g in groups(shape, axes) {
        let m = g.iter().map(|&i| x[i]).sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|&i| (x[i] - m).powi(2)).sum::<f64>() / g.len() as f64;
        for &i in &g {
            y[i] = (x[i] - m) / (var.sqrt() + 1e-9);
        }
    }
    vec![(shape.to_vec(), y)]
}

#[test]
fn mean_variance_normalization_on_every_backend_with_gradients() {
    let shape = [2usize, 3, 4, 5];
    for (k, axes) in [
        None,
        Some(vec![1i64]),
        Some(vec![0, 1, 2, 3]),
        Some(vec![-1, -2]),
    ]
    .into_iter()
    .enumerate()
    {
        let norm: Vec<usize> = axes
            .clone()
            .unwrap_or(vec![0, 2, 3])
            .iter()
            .map(|&a| a.rem_euclid(4) as usize)
            .collect();
        let attrs = axes.iter().map(|a| ints_attr("axes", a)).collect();
        let case = Case::new(
            "MeanVarianceNormalization",
            13,
            vec![("x", Some(rand(&shape, 40 + k as u64, -2.0, 3.0)))],
        )
        .with(attrs);
        let what = format!("MeanVarianceNormalization axes {axes:?}");
        check_case(&what, &case, &BOTH, 1e-5, |v| mvn_ref(&v[0], &shape, &norm));
        check_grads(&what, &case, &[0], k as u64, |v| {
            mvn_ref(&v[0], &shape, &norm)
        });
    }
}

#[test]
fn shrink_on_every_backend_with_gradients() {
    let shape = [4usize, 10];
    for (k, (lambd, bias)) in [
        (None, None),
        (Some(1.5f32), Some(0.5f32)),
        (Some(0.0), Some(-1.0)),
    ]
    .into_iter()
    .enumerate()
    {
        let mut attrs = vec![];
        attrs.extend(lambd.map(|l| float_attr("lambd", l)));
        attrs.extend(bias.map(|b| float_attr("bias", b)));
        let (l, b) = (lambd.unwrap_or(0.5) as f64, bias.unwrap_or(0.0) as f64);
        let reference = |v: &[Vec<f64>]| -> Expected {
            let y = v[0]
                .iter()
                .map(|&x| {
                    if x < -l {
                        x + b
                    } else if x > l {
                        x - b
                    } else {
                        0.0
                    }
                })
                .collect();
            vec![(shape.to_vec(), y)]
        };
        let case = Case::new(
            "Shrink",
            13,
            vec![("x", Some(rand(&shape, 50 + k as u64, -3.0, 3.0)))],
        )
        .with(attrs);
        let what = format!("Shrink lambd {lambd:?} bias {bias:?}");
        check_case(&what, &case, &BOTH, 1e-6, reference);
        check_grads(&what, &case, &[0], k as u64, reference);
    }
}

// ---- DepthToSpace, SpaceToDepth, global pools ---------------------------------------------

fn depth_to_space_ref(x: &[f64], s: &[usize], b: usize, crd: bool) -> Expected {
    let (n, c, h, w) = (s[0], s[1], s[2], s[3]);
    let co = c / (b * b);
    let out = [n, co, h * b, w * b];
    let y = indices(&out)
        .iter()
        .map(|p| {
            let (i, j) = (p[2] % b, p[3] % b);
            let ci = if crd {
                p[1] * b * b + i * b + j
            } else {
                (i * b + j) * co + p[1]
            };
            x[((p[0] * c + ci) * h + p[2] / b) * w + p[3] / b]
        })
        .collect();
    vec![(out.to_vec(), y)]
}

fn space_to_depth_ref(x: &[f64], s: &[usize], b: usize) -> Expected {
    let (n, c, h, w) = (s[0], s[1], s[2], s[3]);
    let out = [n, c * b * b, h / b, w / b];
    let y = indices(&out)
        .iter()
        .map(|p| {
            let (blk, ci) = (p[1] / c, p[1] % c);
            let (i, j) = (blk / b, blk % b);
            x[((p[0] * c + ci) * h + p[2] * b + i) * w + p[3] * b + j]
        })
        .collect();
    vec![(out.to_vec(), y)]
}

#[test]
fn depth_to_space_and_space_to_depth_on_every_backend_with_gradients() {
    for (k, (shape, b, mode)) in [
        (vec![2usize, 8, 3, 2], 2usize, "DCR"),
        (vec![2, 8, 3, 2], 2, "CRD"),
        (vec![1, 18, 2, 3], 3, "DCR"),
        (vec![1, 18, 2, 3], 3, "CRD"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut attrs = vec![int_attr("blocksize", b as i64)];
        if k != 0 {
            attrs.push(str_attr("mode", mode)); // DCR is the default
        }
        let case = Case::new(
            "DepthToSpace",
            13,
            vec![("x", Some(randn(&shape, 60 + k as u64)))],
        )
        .with(attrs);
        let what = format!("DepthToSpace {shape:?} blocksize {b} {mode}");
        let reference = |v: &[Vec<f64>]| depth_to_space_ref(&v[0], &shape, b, mode == "CRD");
        check_case(&what, &case, &BOTH, 0.0, reference);
        check_grads(&what, &case, &[0], k as u64, reference);
    }
    for (k, (shape, b)) in [(vec![2usize, 3, 4, 6], 2usize), (vec![1, 2, 6, 3], 3)]
        .into_iter()
        .enumerate()
    {
        let case = Case::new(
            "SpaceToDepth",
            13,
            vec![("x", Some(randn(&shape, 70 + k as u64)))],
        )
        .with(vec![int_attr("blocksize", b as i64)]);
        let what = format!("SpaceToDepth {shape:?} blocksize {b}");
        let reference = |v: &[Vec<f64>]| space_to_depth_ref(&v[0], &shape, b);
        check_case(&what, &case, &BOTH, 0.0, reference);
        check_grads(&what, &case, &[0], k as u64, reference);
    }
}

#[test]
fn global_pools_on_every_backend_with_gradients() {
    for (k, shape) in [vec![2usize, 3, 4, 5], vec![2, 3, 7], vec![1, 2, 2, 3, 2]]
        .into_iter()
        .enumerate()
    {
        let axes: Vec<usize> = (2..shape.len()).collect();
        let kept: Vec<usize> = (0..shape.len())
            .map(|d| if d < 2 { shape[d] } else { 1 })
            .collect();
        for op in ["GlobalAveragePool", "GlobalMaxPool"] {
            let case = Case::new(op, 13, vec![("x", Some(randn(&shape, 80 + k as u64)))]);
            let reference = |v: &[Vec<f64>]| -> Expected {
                let y = groups(&shape, &axes)
                    .iter()
                    .map(|g| {
                        let it = g.iter().map(|&i| v[0][i]);
                        if op == "GlobalMaxPool" {
                            it.fold(f64::NEG_INFINITY, f64::max)
                        } else {
                            it.sum::<f64>() / g.len() as f64
                        }
                    })
                    .collect();
                vec![(kept.clone(), y)]
            };
            let what = format!("{op} {shape:?}");
            check_case(&what, &case, &BOTH, 1e-6, reference);
            check_grads(&what, &case, &[0], k as u64, reference);
        }
    }
}

// ---- Instance, group and batch normalization ----------------------------------------------

/// (x - mean) / sqrt(var + eps) over each group of flat indices, then `affine(i, x̂)`.
fn normalize_groups(
    x: &[f64],
    groups: &[Vec<usize>],
    eps: f64,
    affine: impl Fn(usize, f64) -> f64,
) -> Vec<f64> {
    let mut y = vec![0.0; x.len()];
    for g in groups {
        let m = g.iter().map(|&i| x[i]).sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|&i| (x[i] - m).powi(2)).sum::<f64>() / g.len() as f64;
        for &i in g {
            y[i] = affine(i, (x[i] - m) / (var + eps).sqrt());
        }
    }
    y
}

/// The channel (axis 1) of flat index i of `shape`.
fn channel(shape: &[usize], i: usize) -> usize {
    let inner: usize = shape[2..].iter().product();
    (i / inner) % shape[1]
}

#[test]
fn instance_normalization_on_every_backend_with_gradients() {
    for (k, (shape, eps)) in [(vec![2usize, 3, 4, 5], 1e-5f32), (vec![2, 3, 7], 0.01)]
        .into_iter()
        .enumerate()
    {
        let c = shape[1];
        let case = Case::new(
            "InstanceNormalization",
            13,
            vec![
                ("x", Some(rand(&shape, 90 + k as u64, -1.0, 2.0))),
                ("scale", Some(rand(&[c], 91, 0.5, 1.5))),
                ("b", Some(randn(&[c], 92))),
            ],
        )
        .with(vec![float_attr("epsilon", eps)]);
        let axes: Vec<usize> = (2..shape.len()).collect();
        let reference = |v: &[Vec<f64>]| -> Expected {
            let y = normalize_groups(&v[0], &groups(&shape, &axes), eps as f64, |i, h| {
                let ch = channel(&shape, i);
                v[1][ch] * h + v[2][ch]
            });
            vec![(shape.clone(), y)]
        };
        let what = format!("InstanceNormalization {shape:?}");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        check_grads(&what, &case, &[0, 1, 2], k as u64, reference);
    }
}

#[test]
fn group_normalization_opsets_18_and_21_on_every_backend_with_gradients() {
    let shape = vec![2usize, 6, 4, 3];
    let (n, c) = (shape[0], shape[1]);
    for (k, (groups_n, opset)) in [(3usize, 21i64), (3, 18), (2, 21), (6, 21), (1, 18)]
        .into_iter()
        .enumerate()
    {
        let per_channel = opset >= 21;
        let pn = if per_channel { c } else { groups_n };
        let case = Case::new(
            "GroupNormalization",
            opset,
            vec![
                ("x", Some(rand(&shape, 100 + k as u64, -1.0, 2.0))),
                ("scale", Some(rand(&[pn], 101, 0.5, 1.5))),
                ("bias", Some(randn(&[pn], 102))),
            ],
        )
        .with(vec![
            int_attr("num_groups", groups_n as i64),
            float_attr("epsilon", 1e-4),
        ]);
        let inner: usize = shape[2..].iter().product();
        let per = c / groups_n;
        // Group g of sample s: channels g·per .. (g+1)·per, every position.
        let gs: Vec<Vec<usize>> = (0..n * groups_n)
            .map(|sg| {
                let (s, g) = (sg / groups_n, sg % groups_n);
                (g * per * inner..(g + 1) * per * inner)
                    .map(|i| s * c * inner + i)
                    .collect()
            })
            .collect();
        let reference = |v: &[Vec<f64>]| -> Expected {
            let y = normalize_groups(&v[0], &gs, 1e-4, |i, h| {
                let ch = channel(&shape, i);
                let p = if per_channel { ch } else { ch / per };
                v[1][p] * h + v[2][p]
            });
            vec![(shape.clone(), y)]
        };
        let what = format!("GroupNormalization opset {opset} groups {groups_n}");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        check_grads(&what, &case, &[0, 1, 2], k as u64, reference);
    }
}

#[test]
fn batch_normalization_inference_on_every_backend_with_gradients() {
    for (k, shape) in [vec![2usize, 3, 4, 5], vec![4, 3], vec![2, 3, 5]]
        .into_iter()
        .enumerate()
    {
        let c = shape[1];
        let case = Case::new(
            "BatchNormalization",
            15,
            vec![
                ("x", Some(randn(&shape, 110 + k as u64))),
                ("scale", Some(rand(&[c], 111, 0.5, 1.5))),
                ("b", Some(randn(&[c], 112))),
                ("mean", Some(randn(&[c], 113))),
                ("var", Some(rand(&[c], 114, 0.5, 2.0))),
            ],
        )
        .with(vec![
            float_attr("epsilon", 1e-3),
            float_attr("momentum", 0.8),
        ]);
        let reference = |v: &[Vec<f64>]| -> Expected {
            let y = (0..v[0].len())
                .map(|i| {
                    let ch = channel(&shape, i);
                    v[1][ch] * (v[0][i] - v[3][ch]) / (v[4][ch] + 1e-3).sqrt() + v[2][ch]
                })
                .collect();
            vec![(shape.clone(), y)]
        };
        let what = format!("BatchNormalization {shape:?}");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        check_grads(&what, &case, &[0, 1, 2, 3, 4], k as u64, reference);
    }
}

/// BatchNormalization with training_mode = 1: normalized by the batch's mean and biased
/// variance per channel, the running statistics as outputs 1 and 2.
#[test]
fn batch_normalization_training_mode_on_every_backend_with_gradients() {
    for (k, shape) in [vec![2usize, 3, 4, 5], vec![4, 3], vec![3, 2, 5]]
        .into_iter()
        .enumerate()
    {
        let c = shape[1];
        let mut case = Case::new(
            "BatchNormalization",
            15,
            vec![
                ("x", Some(randn(&shape, 120 + k as u64))),
                ("scale", Some(rand(&[c], 121, 0.5, 1.5))),
                ("b", Some(randn(&[c], 122))),
                ("mean", Some(randn(&[c], 123))),
                ("var", Some(rand(&[c], 124, 0.5, 2.0))),
            ],
        )
        .with(vec![
            float_attr("epsilon", 1e-3),
            float_attr("momentum", 0.8),
            int_attr("training_mode", 1),
        ]);
        case.outputs = vec!["y", "running_mean", "running_var"];
        let reference = |v: &[Vec<f64>]| -> Expected {
            let (mut sum, mut cnt) = (vec![0.0; c], vec![0.0; c]);
            for (i, x) in v[0].iter().enumerate() {
                sum[channel(&shape, i)] += x;
                cnt[channel(&shape, i)] += 1.0;
            }
            let mean: Vec<f64> = sum.iter().zip(&cnt).map(|(s, n)| s / n).collect();
            let mut var = vec![0.0; c];
            for (i, x) in v[0].iter().enumerate() {
                let ch = channel(&shape, i);
                var[ch] += (x - mean[ch]).powi(2) / cnt[ch];
            }
            let y = (0..v[0].len())
                .map(|i| {
                    let ch = channel(&shape, i);
                    v[1][ch] * (v[0][i] - mean[ch]) / (var[ch] + 1e-3).sqrt() + v[2][ch]
                })
                .collect();
            let run = |old: &[f64], new: &[f64]| -> Vec<f64> {
                old.iter()
                    .zip(new)
                    .map(|(o, b)| 0.8 * o + 0.2 * b)
                    .collect()
            };
            vec![
                (shape.clone(), y),
                (vec![c], run(&v[3], &mean)),
                (vec![c], run(&v[4], &var)),
            ]
        };
        let what = format!("BatchNormalization training {shape:?}");
        // The momentum and 1 - momentum are f32 constants cast to the dtype, as ONNX's
        // function bodies write them: f64 runs carry their f32 rounding (1e-8).
        check_case(&what, &case, &[DType::F32], 1e-5, reference);
        // Only Y is differentiated (`backward` seeds an output it is not given with ones).
        case.outputs = vec!["y"];
        check_grads(&what, &case, &[0, 1, 2], k as u64, reference);
    }
}

// ---- Windows ------------------------------------------------------------------------------

#[test]
fn windows_on_every_backend() {
    for op in ["HannWindow", "HammingWindow", "BlackmanWindow"] {
        let (a0, a1, a2) = match op {
            "HannWindow" => (0.5, 0.5, 0.0),
            "HammingWindow" => (25.0 / 46.0, 21.0 / 46.0, 0.0),
            _ => (0.42, 0.5, 0.08),
        };
        for size in [1i64, 8, 11] {
            for periodic in [0i64, 1] {
                for out_dt in [DType::F32, DType::F64] {
                    if size == 1 && periodic == 0 {
                        continue; // N - 1 = 0: 0/0, as ONNX's definition gives
                    }
                    let case =
                        Case::new(op, 17, vec![("size", Some(i64s(&[], &[size])))]).with(vec![
                            int_attr("periodic", periodic),
                            int_attr("output_datatype", elem_type(out_dt) as i64),
                        ]);
                    let reference = |_: &[Vec<f64>]| -> Expected {
                        let n = (size - 1 + periodic) as f64;
                        let y = (0..size)
                            .map(|k| {
                                let t = std::f64::consts::TAU * k as f64 / n;
                                a0 - a1 * t.cos() + a2 * (2.0 * t).cos()
                            })
                            .collect();
                        vec![(vec![size as usize], y)]
                    };
                    let what = format!("{op} size {size} periodic {periodic} {out_dt}");
                    // Computed in f32 whatever the output type, as the function body does.
                    for backend in backends() {
                        if !computes(backend, out_dt) {
                            continue;
                        }
                        let got = case.run_on(&case.graph(DType::F32), backend, DType::F32, &what);
                        let y = &got[0].1;
                        let (shape, want) = reference(&[]).remove(0);
                        assert_eq!((y.dtype(), y.shape()), (out_dt, &shape[..]), "{what}");
                        // Absolute: the values lie in [0, 1], and some are 0 up to rounding.
                        let e = y
                            .to_f64_vec()
                            .iter()
                            .zip(&want)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0.0, f64::max);
                        assert!(e <= 1e-6, "{what} on {backend:?}: max abs err {e:.2e}");
                    }
                }
            }
        }
    }
}

// ---- RotaryEmbedding ----------------------------------------------------------------------

/// One RotaryEmbedding setting: X's shape ([B, N, S, D] or [B, S, N·D]), num_heads,
/// rotary_embedding_dim, interleaved, and where the positions come from.
#[derive(Clone, Copy)]
struct Rope {
    x: [usize; 4],
    three_d: bool,
    heads_attr: i64,
    dim: usize,
    interleaved: bool,
    pos: RopePos,
    microsoft: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum RopePos {
    /// Caches given per token, [B, S, d/2].
    None,
    /// position_ids [B, S] into caches of `rows` rows.
    Ids(usize),
    /// ONNX Runtime's start position [1] (token s at p + s) into `rows` rows.
    Start(usize),
}

impl Rope {
    /// (B, N, S, D), and d (the rotated width).
    fn dims(&self) -> (usize, usize, usize, usize, usize) {
        let [b, n, s, d] = self.x;
        (b, n, s, d, if self.dim == 0 { d } else { self.dim })
    }
    fn x_shape(&self) -> Vec<usize> {
        let (b, n, s, d, _) = self.dims();
        if self.three_d {
            vec![b, s, n * d]
        } else {
            vec![b, n, s, d]
        }
    }
    fn case(&self, seed: u64) -> Case {
        let (b, _, s, _, rd) = self.dims();
        let x = randn(&self.x_shape(), seed);
        let cache_shape = match self.pos {
            RopePos::None => vec![b, s, rd / 2],
            RopePos::Ids(rows) | RopePos::Start(rows) => vec![rows, rd / 2],
        };
        // Angles of any size: cos and sin need not be a rotation's for the formula.
        let cos = rand(&cache_shape, seed + 1, -1.0, 1.0);
        let sin = rand(&cache_shape, seed + 2, -1.0, 1.0);
        let pos = match self.pos {
            RopePos::None => None,
            RopePos::Ids(rows) => Some(rand_ints(&[b, s], seed + 3, 0, rows as i64)),
            RopePos::Start(rows) => Some(i64s(&[1], &[(rows - s) as i64])),
        };
        let mut attrs = vec![int_attr("interleaved", self.interleaved as i64)];
        if self.heads_attr > 0 {
            attrs.push(int_attr("num_heads", self.heads_attr));
        }
        if self.dim > 0 {
            attrs.push(int_attr("rotary_embedding_dim", self.dim as i64));
        }
        let pos_in = (if pos.is_some() { "pos" } else { "" }, pos);
        let ins = if self.microsoft {
            vec![
                ("x", Some(x)),
                pos_in,
                ("cos", Some(cos)),
                ("sin", Some(sin)),
            ]
        } else {
            vec![
                ("x", Some(x)),
                ("cos", Some(cos)),
                ("sin", Some(sin)),
                pos_in,
            ]
        };
        let mut case = Case::new("RotaryEmbedding", 23, ins).with(attrs);
        if self.microsoft {
            case.domain = "com.microsoft";
        }
        case.symbolic = true;
        case
    }
    /// The float64 reference on the case's inputs (in the case's order).
    fn reference(&self, v: &[Vec<f64>]) -> Expected {
        let (x, pos, cos, sin) = if self.microsoft {
            (&v[0], &v[1], &v[2], &v[3])
        } else {
            (&v[0], &v[3], &v[1], &v[2])
        };
        let (b, n, s, d, rd) = self.dims();
        let half = rd / 2;
        let mut y = x.clone();
        for (bi, hi, si) in
            (0..b).flat_map(|bi| (0..n).flat_map(move |hi| (0..s).map(move |si| (bi, hi, si))))
        {
            let base = if self.three_d {
                ((bi * s + si) * n + hi) * d
            } else {
                ((bi * n + hi) * s + si) * d
            };
            let row = match self.pos {
                RopePos::None => bi * s + si,
                RopePos::Ids(_) => pos[bi * s + si] as usize,
                RopePos::Start(_) => pos[0] as usize + si,
            };
            for i in 0..half {
                let (j1, j2) = if self.interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (c, sn) = (cos[row * half + i], sin[row * half + i]);
                let (x1, x2) = (x[base + j1], x[base + j2]);
                y[base + j1] = c * x1 - sn * x2;
                y[base + j2] = sn * x1 + c * x2;
            }
        }
        vec![(self.x_shape(), y)]
    }
}

fn rope_settings() -> Vec<Rope> {
    let r = |x, three_d, heads_attr, dim, interleaved, pos| Rope {
        x,
        three_d,
        heads_attr,
        dim,
        interleaved,
        pos,
        microsoft: false,
    };
    let ms = |mut r: Rope| {
        r.microsoft = true;
        r
    };
    vec![
        r([2, 3, 5, 8], false, 0, 0, false, RopePos::Ids(12)),
        r([2, 3, 5, 8], false, 3, 0, true, RopePos::Ids(12)),
        r([2, 3, 5, 8], true, 3, 4, false, RopePos::Ids(9)),
        r([2, 2, 5, 8], false, 0, 4, true, RopePos::None),
        // The whole head named as the rotated part: nothing passes through.
        r([1, 2, 5, 6], true, 2, 6, false, RopePos::None),
        r([2, 3, 4, 10], true, 3, 6, true, RopePos::Ids(7)),
        ms(r([2, 2, 5, 8], true, 0, 0, false, RopePos::Start(9))),
        ms(r([2, 2, 5, 8], false, 0, 0, true, RopePos::Start(5))),
        ms(r([2, 2, 5, 8], false, 2, 4, true, RopePos::Ids(12))),
        ms(r([2, 3, 4, 8], true, 3, 6, false, RopePos::Ids(6))),
    ]
}

fn rope_what(r: &Rope) -> String {
    format!(
        "RotaryEmbedding{} x {:?} heads {} dim {} interleaved {} positions {}",
        if r.microsoft { " (com.microsoft)" } else { "" },
        r.x_shape(),
        r.heads_attr,
        r.dim,
        r.interleaved,
        match r.pos {
            RopePos::None => "in the caches".to_string(),
            RopePos::Ids(rows) => format!("ids into {rows} rows"),
            RopePos::Start(rows) => format!("from a start into {rows} rows"),
        }
    )
}

#[test]
fn rotary_embedding_on_every_backend_with_gradients() {
    for (k, rope) in rope_settings().into_iter().enumerate() {
        let case = rope.case(300 + 10 * k as u64);
        let what = rope_what(&rope);
        check_case(&what, &case, &BOTH, 1e-6, |v| rope.reference(v));
        // X and both caches (the caches through Gather where there are positions).
        let (xi, ci, si) = if rope.microsoft { (0, 2, 3) } else { (0, 1, 2) };
        check_grads(&what, &case, &[xi, ci, si], k as u64, |v| rope.reference(v));
    }
}

// ---- QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear -----------------------------

/// Round half to even.
fn round_even(v: f64) -> f64 {
    let r = v.round();
    if (v - v.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - v.signum()
    } else {
        r
    }
}

/// The saturation range of a quantized type.
fn q_range(dt: DType) -> (f64, f64) {
    match dt {
        DType::U8 => (0.0, 255.0),
        DType::I8 => (-128.0, 127.0),
        DType::U16 => (0.0, 65535.0),
        DType::I16 => (-32768.0, 32767.0),
        _ => unreachable!(),
    }
}

/// How a scale (and zero point) maps onto x: per tensor, per axis, or blocked.
#[derive(Clone, Copy, Debug)]
enum QLayout {
    /// A scalar (`false`) or a one-element vector (`true`).
    Tensor(bool),
    Axis(i64),
    Blocked(i64, usize),
}

impl QLayout {
    /// The shape of the scale for x of `shape`.
    fn param_shape(&self, shape: &[usize]) -> Vec<usize> {
        let r = shape.len() as i64;
        match *self {
            QLayout::Tensor(false) => vec![],
            QLayout::Tensor(true) => vec![1],
            QLayout::Axis(a) => vec![shape[a.rem_euclid(r) as usize]],
            QLayout::Blocked(a, b) => {
                let a = a.rem_euclid(r) as usize;
                let mut s = shape.to_vec();
                s[a] = s[a].div_ceil(b);
                s
            }
        }
    }
    /// The index into the scale for each element of x.
    fn param_index(&self, shape: &[usize]) -> Vec<usize> {
        let r = shape.len() as i64;
        let ps = self.param_shape(shape);
        indices(shape)
            .iter()
            .map(|p| match *self {
                QLayout::Tensor(_) => 0,
                QLayout::Axis(a) => p[a.rem_euclid(r) as usize],
                QLayout::Blocked(a, b) => {
                    let a = a.rem_euclid(r) as usize;
                    let mut q = p.clone();
                    q[a] /= b;
                    q.iter().zip(strides(&ps)).map(|(i, s)| i * s).sum()
                }
            })
            .collect()
    }
    fn attrs(&self) -> Vec<AttributeProto> {
        match *self {
            QLayout::Tensor(_) => vec![],
            QLayout::Axis(a) => vec![int_attr("axis", a)],
            QLayout::Blocked(a, b) => vec![int_attr("axis", a), int_attr("block_size", b as i64)],
        }
    }
}

/// One quantization setting.
#[derive(Clone, Debug)]
struct Quant {
    shape: Vec<usize>,
    layout: QLayout,
    /// The quantized type.
    dt: DType,
    zero_point: bool,
    /// The type named by output_dtype.
    out_attr: bool,
}

fn quant_settings() -> Vec<Quant> {
    let q = |shape: &[usize], layout, dt, zero_point, out_attr| Quant {
        shape: shape.to_vec(),
        layout,
        dt,
        zero_point,
        out_attr,
    };
    vec![
        q(&[3, 4], QLayout::Tensor(false), DType::U8, false, false),
        q(&[3, 4], QLayout::Tensor(false), DType::I8, true, false),
        q(&[2, 3, 4], QLayout::Tensor(true), DType::U8, true, false),
        q(&[2, 3, 4], QLayout::Axis(1), DType::U8, true, false),
        q(&[2, 3, 4], QLayout::Axis(-1), DType::I16, true, false),
        q(&[4, 3, 2], QLayout::Axis(0), DType::U16, true, false),
        q(&[2, 5, 2], QLayout::Blocked(1, 3), DType::I8, true, false),
        q(&[6, 2], QLayout::Blocked(-2, 2), DType::U8, false, false),
        q(&[3, 4], QLayout::Axis(1), DType::I8, false, true),
        q(&[2, 6], QLayout::Blocked(1, 4), DType::I16, false, true),
    ]
}

impl Quant {
    fn what(&self, op: &str) -> String {
        format!("{op} {self:?}")
    }
    fn param_shape(&self) -> Vec<usize> {
        self.layout.param_shape(&self.shape)
    }
    /// A zero point for each scale element (inside the type's range, off-centre).
    fn zero_points(&self, seed: u64) -> Option<Tensor> {
        let (lo, hi) = q_range(self.dt);
        let (lo, hi) = ((lo + (hi - lo) * 0.3) as i64, (lo + (hi - lo) * 0.7) as i64);
        let t = rand_ints(&self.param_shape(), seed, lo, hi).cast(self.dt);
        self.zero_point.then_some(t)
    }
    fn case(&self, op: &'static str, opset: i64, x: Tensor, scale: Tensor, seed: u64) -> Case {
        let mut attrs = self.layout.attrs();
        if self.out_attr {
            // QuantizeLinear's quantized type; DequantizeLinear's output in f64.
            let to = if op == "QuantizeLinear" {
                self.dt
            } else {
                DType::F64
            };
            attrs.push(int_attr("output_dtype", elem_type(to) as i64));
        }
        let zp = self.zero_points(seed);
        let mut case = Case::new(
            op,
            opset,
            vec![
                ("x", Some(x)),
                ("scale", Some(scale)),
                (if zp.is_some() { "zp" } else { "" }, zp),
            ],
        )
        .with(attrs);
        case.symbolic = true;
        case
    }
}

#[test]
fn quantize_linear_on_every_backend() {
    for (k, q) in quant_settings().into_iter().enumerate() {
        let seed = 400 + 10 * k as u64;
        let ps = q.param_shape();
        let at = q.layout.param_index(&q.shape);
        // Powers of two as scales, so that x / scale is exact in every float type, and
        // x at (m + f)·scale with f in (-0.4, 0.4) or a tie (±0.5): the rounding is the
        // definition's alone. |m| reaches past the type's range, so some saturate.
        let scales: Vec<f64> = rand_ints(&ps, seed, -3, 3)
            .to_i64_vec()
            .iter()
            .map(|&e| 2f64.powi(e as i32))
            .collect();
        let (lo, hi) = q_range(q.dt);
        let span = (hi - lo) * 0.7;
        let m = rand(&q.shape, seed + 1, -span, span).to_f64_vec();
        let f = rand(&q.shape, seed + 2, -0.4, 0.4).to_f64_vec();
        let frac = |i: usize| match i % 5 {
            0 => 0.5,
            1 => -0.5,
            _ => f[i],
        };
        let xv: Vec<f64> = (0..m.len())
            .map(|i| (m[i].round() + frac(i)) * scales[at[i]])
            .collect();
        let x = f64s(&q.shape, &xv);
        let case = q.case("QuantizeLinear", 21, x, f64s(&ps, &scales), seed + 3);
        let what = q.what("QuantizeLinear");
        check_case(&what, &case, &BOTH, 0.0, |v| {
            let y = (0..v[0].len())
                .map(|i| {
                    let z = if q.zero_point { v[2][at[i]] } else { 0.0 };
                    (round_even(v[0][i] / v[1][at[i]]) + z).clamp(lo, hi)
                })
                .collect();
            vec![(q.shape.clone(), y)]
        });
        // The output type is the zero point's (or output_dtype's, or uint8).
        let got = Session::new(case.graph(DType::F32), SessionOptions::unfused())
            .unwrap()
            .run(&case.feeds(&case.args(DType::F32)))
            .unwrap();
        assert_eq!(got[0].1.dtype(), q.dt, "{what}");
    }
}

/// The narrow element types: a packed INT4 initializer (two values a byte, an odd count)
/// read and dequantized per row; QuantizeLinear to INT4 (rounding half to even, saturating
/// to −8..7) and to FLOAT8E4M3FN (rounding to the 8-bit float, saturating at ±448), Cast
/// without saturation, the expected values worked out by hand; CUDA and WebGPU refuse the
/// types by name.
#[test]
fn narrow_element_types() {
    use graphrun::onnx::proto::TensorProto;
    let run = |bytes: &[u8], feeds: &[(&str, Tensor)], backend| {
        let g = graphrun::onnx::from_bytes(bytes, "narrow", std::path::Path::new("."))
            .unwrap_or_else(|e| panic!("import: {e}"));
        let opts = SessionOptions {
            backend,
            ..SessionOptions::unfused()
        };
        let feeds: HashMap<String, Tensor> = feeds
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        Session::new(g, opts).and_then(|mut s| s.run(&feeds))
    };
    let packed = |name: &str, dims: &[i64], code: i32, vals: &[i8]| TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: code,
        raw_data: vals
            .chunks(2)
            .map(|c| (c[0] as u8 & 0xf) | (c.get(1).map_or(0, |&v| v as u8 & 0xf) << 4))
            .collect(),
        ..Default::default()
    };
    // DequantizeLinear of an INT4 [3, 3] weight, a scale per row.
    let w: [i8; 9] = [-8, -3, 0, 1, 7, -1, 5, -6, 2];
    let scale = [0.5f32, 0.25, 2.0];
    let dq = model_bytes(
        vec![node(
            "DequantizeLinear",
            "",
            &["w", "s"],
            &["y"],
            vec![int_attr("axis", 0)],
        )],
        21,
        vec![],
        vec![
            packed("w", &[3, 3], 22, &w),
            initializer("s", &Tensor::from_vec(&[3], scale.to_vec()).unwrap()),
        ],
        &["y"],
    );
    let want: Vec<f64> = (0..9).map(|i| w[i] as f64 * scale[i / 3] as f64).collect();
    let got = run(&dq, &[], BackendKind::Cpu).unwrap();
    assert_eq!(got[0].1.to_f64_vec(), want);
    // QuantizeLinear to INT4 (the zero point's type) and to FLOAT8E4M3FN (output_dtype).
    let x = Tensor::from_vec(&[5], vec![-9.6f32, 2.5, 3.5, 7.4, 100.0]).unwrap();
    let one = Tensor::scalar(1.0f32);
    let q4 = model_bytes(
        vec![node("QuantizeLinear", "", &["x", "s", "z"], &["q"], vec![])],
        21,
        vec![input_like("x", &x)],
        vec![initializer("s", &one), packed("z", &[], 22, &[0])],
        &["q"],
    );
    // Every backend: CUDA and WebGPU cast to and from the narrow types.
    for be in backends() {
        let got = run(&q4, &[("x", x.clone())], be).unwrap();
        assert_eq!(got[0].1.dtype(), DType::I4);
        assert_eq!(got[0].1.to_f64_vec(), [-8.0, 2.0, 4.0, 7.0, 7.0], "{be:?}");
    }
    let x = Tensor::from_vec(&[5], vec![0.3f32, -1000.0, 3.15, 1e-9, 17.5]).unwrap();
    let q8 = model_bytes(
        vec![node(
            "QuantizeLinear",
            "",
            &["x", "s"],
            &["q"],
            vec![int_attr("output_dtype", 17)],
        )],
        21,
        vec![input_like("x", &x)],
        vec![initializer("s", &one)],
        &["q"],
    );
    for be in backends() {
        let got = run(&q8, &[("x", x.clone())], be).unwrap();
        assert_eq!(got[0].1.dtype(), DType::F8E4M3FN);
        // 0.3 is 9.6 steps of 2⁻⁵ (→ 10), 3.15 12.6 of 2⁻² (→ 13), 17.5 8.75 of 2 (→ 9).
        assert_eq!(
            got[0].1.to_f64_vec(),
            [0.3125, -448.0, 3.25, 0.0, 18.0],
            "{be:?}"
        );
    }
    // Cast with saturate 0: past the last rounding bound, NaN (E4M3FN: 464 is a tie that
    // rounds to 448, whose mantissa is even) or ±infinity (E5M2: 61440 ties up to 2¹⁶).
    for (to, xs, want) in [
        (
            17,
            vec![1e6f32, -1e6, 448.0, 464.0, 465.0],
            vec![f64::NAN, f64::NAN, 448.0, 448.0, f64::NAN],
        ),
        (
            19,
            vec![61440.0, 61439.0, -1e6, 1.0],
            vec![f64::INFINITY, 57344.0, f64::NEG_INFINITY, 1.0],
        ),
    ] {
        let x = Tensor::from_vec(&[xs.len()], xs).unwrap();
        let attrs = vec![int_attr("to", to), int_attr("saturate", 0)];
        let m = model_bytes(
            vec![node("Cast", "", &["x"], &["y"], attrs)],
            21,
            vec![input_like("x", &x)],
            vec![],
            &["y"],
        );
        for be in backends() {
            let got = run(&m, &[("x", x.clone())], be).unwrap()[0].1.to_f64_vec();
            let same = got
                .iter()
                .zip(&want)
                .all(|(g, w)| g == w || (g.is_nan() && w.is_nan()));
            assert!(
                same,
                "Cast to {to} without saturation on {be:?}: {got:?}, want {want:?}"
            );
        }
    }
    // The narrow types are for storage: arithmetic on them is refused on every backend,
    // naming the node's type.
    let a = Tensor::from_bytes(DType::I4, &[2], &[3, 5]).unwrap();
    let add = model_bytes(
        vec![node("Add", "", &["a", "a"], &["y"], vec![])],
        21,
        vec![input_like("a", &a)],
        vec![],
        &["y"],
    );
    for be in backends() {
        let e = run(&add, &[("a", a.clone())], be).unwrap_err().to_string();
        assert!(e.contains("Add") && e.contains("i4"), "{be:?}: {e}");
    }
}

#[test]
fn dequantize_linear_on_every_backend_with_gradients() {
    for (k, q) in quant_settings().into_iter().enumerate() {
        let seed = 500 + 10 * k as u64;
        let at = q.layout.param_index(&q.shape);
        let (lo, hi) = q_range(q.dt);
        let x = rand_ints(&q.shape, seed, lo as i64, hi as i64 + 1).cast(q.dt);
        let scale = rand(&q.param_shape(), seed + 1, 0.01, 2.0);
        let case = q.case("DequantizeLinear", 23, x, scale, seed + 2);
        let what = q.what("DequantizeLinear");
        let centered =
            |v: &[Vec<f64>], i: usize| v[0][i] - if q.zero_point { v[2][at[i]] } else { 0.0 };
        // In f32, as ONNX's reference computes it, then cast: exact in either dtype.
        let dtypes: &[DType] = if q.out_attr { &[DType::F32] } else { &BOTH };
        check_case(&what, &case, dtypes, 0.0, |v| {
            let y = (0..v[0].len())
                .map(|i| (centered(v, i) as f32 * v[1][at[i]] as f32) as f64)
                .collect();
            vec![(q.shape.clone(), y)]
        });
        if !q.out_attr {
            // d/dscale against the exact formula (the f32 steps are good to 1e-7).
            check_grads(&what, &case, &[1], k as u64, |v| {
                let y = (0..v[0].len())
                    .map(|i| centered(v, i) * v[1][at[i]])
                    .collect();
                vec![(q.shape.clone(), y)]
            });
        }
    }
}

#[test]
fn dynamic_quantize_linear_on_every_backend() {
    for (k, (shape, lo, hi)) in [
        (vec![3usize, 4], -2.0, 3.0),
        // All positive: the minimum is taken as 0; all negative: the maximum.
        (vec![2, 3, 2], 0.5, 4.0),
        (vec![7], -5.0, -0.25),
    ]
    .into_iter()
    .enumerate()
    {
        let mut case = Case::new(
            "DynamicQuantizeLinear",
            11,
            vec![("x", Some(rand(&shape, 600 + k as u64, lo, hi)))],
        );
        case.outputs = vec!["y", "y_scale", "y_zero_point"];
        case.symbolic = true;
        let what = format!("DynamicQuantizeLinear x in [{lo}, {hi})");
        // The function body, in f32.
        check_case(&what, &case, &[DType::F32], 0.0, |v| {
            let x: Vec<f32> = v[0].iter().map(|&x| x as f32).collect();
            let lo = x.iter().fold(0f32, |a, &b| a.min(b));
            let hi = x.iter().fold(0f32, |a, &b| a.max(b));
            let scale = (hi - lo) / 255.0;
            let zp = round_even((0.0 - lo / scale).clamp(0.0, 255.0) as f64);
            let y = x
                .iter()
                .map(|&x| (round_even((x / scale) as f64) + zp).clamp(0.0, 255.0))
                .collect();
            vec![
                (shape.clone(), y),
                (vec![], vec![scale as f64]),
                (vec![], vec![zp]),
            ]
        });
    }
}

// ---- CenterCropPad, LRN -------------------------------------------------------------------

#[test]
fn center_crop_pad_on_every_backend_with_gradients() {
    for (k, (shape, size, axes)) in [
        (vec![4usize, 5, 3], vec![2i64, 8, 3], None),
        (vec![3, 6, 5], vec![8, 2], Some(vec![-1i64, 0])),
        (vec![5, 4], vec![1], Some(vec![1])),
        (vec![2, 7, 2], vec![4, 4], Some(vec![1, 2])),
    ]
    .into_iter()
    .enumerate()
    {
        let r = shape.len() as i64;
        let axes_n: Vec<usize> = match &axes {
            None => (0..shape.len()).collect(),
            Some(a) => a.iter().map(|&a| a.rem_euclid(r) as usize).collect(),
        };
        // Per axis: the output dim, and the input index of output index 0 (crop start
        // minus pad before).
        let mut out = shape.clone();
        let mut shift = vec![0i64; shape.len()];
        for (&a, &s) in axes_n.iter().zip(&size) {
            let d = shape[a] as i64 - s;
            out[a] = s as usize;
            shift[a] = if d >= 0 { d / 2 } else { -((-d) / 2) };
        }
        let mut case = Case::new(
            "CenterCropPad",
            18,
            vec![
                ("x", Some(randn(&shape, 700 + k as u64))),
                ("shape", Some(i64s(&[size.len()], &size))),
            ],
        )
        .with(axes.iter().map(|a| ints_attr("axes", a)).collect());
        case.symbolic = true;
        let reference = |v: &[Vec<f64>]| -> Expected {
            let st = strides(&shape);
            let y = indices(&out)
                .iter()
                .map(|p| {
                    let mut flat = 0;
                    for (d, &i) in p.iter().enumerate() {
                        let j = i as i64 + shift[d];
                        if j < 0 || j >= shape[d] as i64 {
                            return 0.0;
                        }
                        flat += j as usize * st[d];
                    }
                    v[0][flat]
                })
                .collect();
            vec![(out.clone(), y)]
        };
        let what = format!("CenterCropPad {shape:?} to {size:?} on axes {axes:?}");
        check_case(&what, &case, &BOTH, 0.0, reference);
        check_grads(&what, &case, &[0], k as u64, reference);
    }
}

#[test]
fn lrn_on_every_backend_with_gradients() {
    for (k, (shape, size, alpha, beta, bias)) in [
        (vec![2usize, 5, 3, 3], 3i64, None, None, None),
        (
            vec![2, 5, 3, 3],
            4,
            Some(0.01f32),
            Some(0.5f32),
            Some(2.0f32),
        ),
        (vec![1, 4, 2, 2], 1, Some(0.1), Some(1.5), Some(1.0)),
        // A window wider than the channels.
        (vec![2, 5, 2, 1], 7, Some(0.2), Some(0.75), Some(0.5)),
        (vec![2, 6, 4], 5, Some(0.05), None, Some(1.5)),
    ]
    .into_iter()
    .enumerate()
    {
        let mut attrs = vec![int_attr("size", size)];
        attrs.extend(alpha.map(|v| float_attr("alpha", v)));
        attrs.extend(beta.map(|v| float_attr("beta", v)));
        attrs.extend(bias.map(|v| float_attr("bias", v)));
        let (alpha, beta, bias) = (
            alpha.unwrap_or(1e-4) as f64,
            beta.unwrap_or(0.75) as f64,
            bias.unwrap_or(1.0) as f64,
        );
        let mut case = Case::new(
            "LRN",
            13,
            vec![("x", Some(rand(&shape, 800 + k as u64, -2.0, 2.0)))],
        )
        .with(attrs);
        case.symbolic = true;
        let c = shape[1] as i64;
        let (lo, hi) = ((size - 1) / 2, size / 2);
        let inner: usize = shape[2..].iter().product();
        let reference = |v: &[Vec<f64>]| -> Expected {
            let y = (0..v[0].len())
                .map(|i| {
                    let (nc, rest) = (i / inner, i % inner);
                    let (b, ch) = (nc as i64 / c, nc as i64 % c);
                    let s: f64 = (ch - lo..=ch + hi)
                        .filter(|j| (0..c).contains(j))
                        .map(|j| v[0][((b * c + j) as usize) * inner + rest].powi(2))
                        .sum();
                    v[0][i] / (bias + alpha / size as f64 * s).powf(beta)
                })
                .collect();
            vec![(shape.clone(), y)]
        };
        let what = format!("LRN {shape:?} size {size} alpha {alpha} beta {beta} bias {bias}");
        check_case(&what, &case, &BOTH, 1e-6, reference);
        check_grads(&what, &case, &[0], k as u64, reference);
    }
}

// ---- Refusals -----------------------------------------------------------------------------

#[test]
fn unsupported_attribute_values_are_refused_by_name() {
    let x = || Some(randn(&[2, 4, 2, 2], 1));
    let microsoft = |mut c: Case| {
        c.domain = "com.microsoft";
        c
    };
    let pos = Some(i64s(&[1], &[0]));
    let rope4 = vec![("x", x()), ("pos", pos), ("c", x()), ("s", x())];
    let cases: Vec<(Case, &str)> = vec![
        (
            Case::new("LpNormalization", 13, vec![("x", x())]).with(vec![int_attr("p", 3)]),
            "attribute 'p' must be 1 or 2, got 3",
        ),
        (
            Case::new("DepthToSpace", 13, vec![("x", x())])
                .with(vec![int_attr("blocksize", 2), str_attr("mode", "XYZ")]),
            "attribute 'mode' must be \"DCR\" or \"CRD\"",
        ),
        (
            Case::new("SpaceToDepth", 13, vec![("x", x())]),
            "attribute 'blocksize' is required",
        ),
        (
            Case::new(
                "BatchNormalization",
                7,
                ["x", "s", "b", "m", "v"]
                    .into_iter()
                    .zip([x(), x(), x(), x(), x()])
                    .collect(),
            )
            .with(vec![int_attr("spatial", 0)]),
            "attribute 'spatial' = 0 is not supported",
        ),
        (
            Case::new(
                "NegativeLogLikelihoodLoss",
                13,
                vec![("x", x()), ("t", x())],
            )
            .with(vec![str_attr("reduction", "max")]),
            "attribute 'reduction' must be",
        ),
        (
            Case::new("RMSNormalization", 23, vec![("x", x()), ("s", x())])
                .with(vec![int_attr("stash_type", 7)]),
            "it must name a floating type",
        ),
        (
            Case::new("HannWindow", 17, vec![("size", Some(i64s(&[], &[4])))])
                .with(vec![int_attr("output_datatype", 8)]),
            "attribute 'output_datatype' names STRING",
        ),
        (
            Case::new("Shrink", 13, vec![("x", x())]).with(vec![int_attr("alpha", 1)]),
            "unknown attribute 'alpha'",
        ),
        (
            Case::new("LRN", 13, vec![("x", x())]),
            "attribute 'size' is required",
        ),
        (
            Case::new("LRN", 13, vec![("x", x())]).with(vec![int_attr("size", 0)]),
            "attribute 'size' must be in 1..=256, got 0",
        ),
        (
            Case::new("QuantizeLinear", 25, vec![("x", x()), ("s", x())])
                .with(vec![int_attr("output_dtype", 24)]),
            "output type FLOAT8E8M0 is not a quantized type graphrun has",
        ),
        (
            Case::new("QuantizeLinear", 21, vec![("x", x()), ("s", x())])
                .with(vec![int_attr("output_dtype", 17), int_attr("saturate", 0)]),
            "attribute 'saturate'",
        ),
        (
            Case::new("QuantizeLinear", 21, vec![("x", x()), ("s", x())])
                .with(vec![int_attr("block_size", -1)]),
            "attribute 'block_size' must be non-negative, got -1",
        ),
        (
            Case::new("DequantizeLinear", 23, vec![("x", x()), ("s", x())])
                .with(vec![int_attr("output_dtype", 3)]),
            "attribute 'output_dtype' must name a floating type graphrun has, got INT8",
        ),
        (
            Case::new(
                "RotaryEmbedding",
                23,
                vec![("x", x()), ("c", x()), ("s", x())],
            )
            .with(vec![int_attr("rotary_embedding_dim", 3)]),
            "attribute 'rotary_embedding_dim' must be a non-negative even number, got 3",
        ),
        (
            Case::new(
                "RotaryEmbedding",
                23,
                vec![("x", x()), ("c", x()), ("s", x())],
            )
            .with(vec![int_attr("interleaved", 2)]),
            "attribute 'interleaved' must be 0 or 1, got 2",
        ),
        (
            microsoft(
                Case::new("RotaryEmbedding", 23, rope4.clone())
                    .with(vec![float_attr("scale", 0.5)]),
            ),
            "attribute 'scale' = 0.5 is not supported",
        ),
        (
            microsoft(
                Case::new("RotaryEmbedding", 23, rope4.clone())
                    .with(vec![int_attr("is_packed_batching", 1)]),
            ),
            "attribute 'is_packed_batching' = 1 (ragged batches) is not supported",
        ),
        (
            microsoft(
                Case::new("RotaryEmbedding", 23, rope4)
                    .with(vec![int_attr("rotary_embedding_dim", 2)]),
            ),
            "attribute 'rotary_embedding_dim' needs num_heads",
        ),
    ];
    for (case, want) in cases {
        let args = case.args(DType::F32);
        let names: Vec<&str> = case.inputs.iter().map(|(n, _)| *n).collect();
        let infos = case
            .inputs
            .iter()
            .zip(&args)
            .filter_map(|((n, _), t)| t.as_ref().map(|t| input_like(n, t)))
            .collect();
        let n = node(
            case.op,
            case.domain,
            &names,
            &case.outputs,
            case.attrs.clone(),
        );
        let e = import_one_node(n, case.opset, infos, vec![])
            .err()
            .unwrap_or_else(|| panic!("{}: imported", case.op))
            .to_string();
        let node_name = format!("node '{}_node' ({})", case.op, case.op);
        assert!(
            e.contains(&node_name) && e.contains(want),
            "{}: {e}",
            case.op
        );
    }
    // SkipSimplifiedLayerNormalization's mean output is not an RMS normalization's.
    let mut case = Case::new(
        "SkipSimplifiedLayerNormalization",
        17,
        vec![("x", x()), ("skip", x()), ("g", Some(randn(&[2], 3)))],
    );
    case.domain = "com.microsoft";
    case.outputs = vec!["y", "mean"];
    let n = node(
        case.op,
        case.domain,
        &["x", "skip", "g"],
        &case.outputs,
        vec![],
    );
    let infos = vec![
        input("x", DType::F32, &[Some(2), Some(2)]),
        input("skip", DType::F32, &[Some(2), Some(2)]),
        input("g", DType::F32, &[Some(2)]),
    ];
    let e = import_one_node(n, 17, infos, vec![])
        .unwrap_err()
        .to_string();
    assert!(e.contains("output 1 (mean)"), "{e}");
}

// ---- ReduceMin / ReduceMax on bools and integers -------------------------------------

#[test]
fn reduce_min_and_max_on_bools_and_integer_extremes() {
    // Bools: Max is Or, Min is And. Integers at their extremes, where -x overflows (i8's
    // -128) or wraps (unsigned 0 and 255).
    let bools = common::bools(&[3, 2], &[true, false, true, true, false, false]);
    let cases: Vec<(Tensor, Vec<f64>)> = vec![
        (bools, vec![]),
        (
            Tensor::from_vec(&[2, 3], vec![0u8, 255, 7, 200, 0, 1]).unwrap(),
            vec![],
        ),
        (
            Tensor::from_vec(&[2, 3], vec![-128i8, 127, 0, 5, -1, -128]).unwrap(),
            vec![],
        ),
        (
            Tensor::from_vec(&[2, 3], vec![i64::MIN, 3, i64::MAX, 0, -7, 9]).unwrap(),
            vec![],
        ),
    ];
    for (x, _) in cases {
        let v = x.to_f64_vec();
        let (rows, cols) = (x.shape()[0], x.shape()[1]);
        for op in ["ReduceMin", "ReduceMax"] {
            let mut c = Case::new(
                op,
                18,
                vec![("x", Some(x.clone())), ("axes", Some(i64s(&[1], &[1])))],
            );
            c.attrs = vec![int_attr("keepdims", 0)];
            let want: Vec<f64> = (0..rows)
                .map(|r| {
                    let row = v[r * cols..(r + 1) * cols].iter().copied();
                    if op == "ReduceMin" {
                        row.fold(f64::INFINITY, f64::min)
                    } else {
                        row.fold(f64::NEG_INFINITY, f64::max)
                    }
                })
                .collect();
            let g = c.graph(DType::F32);
            for backend in backends() {
                let opts = SessionOptions {
                    backend,
                    ..SessionOptions::unfused()
                };
                let got = Session::new(g.clone(), opts)
                    .and_then(|mut s| s.run(&c.feeds(&c.args(DType::F32))));
                match got {
                    Ok(got) => {
                        assert_eq!(
                            got[0].1.dtype(),
                            x.dtype(),
                            "{op} {} on {backend:?}",
                            x.dtype()
                        );
                        assert_eq!(
                            got[0].1.to_f64_vec(),
                            want,
                            "{op} {} on {backend:?}",
                            x.dtype()
                        );
                    }
                    Err(e) => assert!(
                        graphrun::backends::not_on(backend, x.dtype())
                            || e.to_string().contains(WGPU_NO_I64),
                        "{op} {} on {backend:?}: {e}",
                        x.dtype()
                    ),
                }
            }
        }
    }
}

// ---- Attention with a softcap --------------------------------------------------------------

/// Attention by ONNX's definition on `[B, H, S, D]` inputs: scores Q·Kᵀ·scale capped by
/// softcap·tanh(s/softcap), plus the additive mask `[Sq, Skv]` and the causal triangle,
/// softmax over keys, times V; K/V head h serves query heads h·r .. (h+1)·r.
#[allow(clippy::too_many_arguments)]
fn softcap_attention_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    mask: Option<&[f64]>,
    [b, hq, hkv, sq, skv, d]: [usize; 6],
    softcap: f64,
    causal: bool,
) -> Vec<f64> {
    let scale = 1.0 / (d as f64).sqrt();
    let r = hq / hkv;
    let mut y = vec![0.0; b * hq * sq * d];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / r;
            for i in 0..sq {
                let mut s: Vec<f64> = (0..skv)
                    .map(|j| {
                        let dot: f64 = (0..d)
                            .map(|t| {
                                q[((bi * hq + h) * sq + i) * d + t]
                                    * k[((bi * hkv + kh) * skv + j) * d + t]
                            })
                            .sum();
                        let mut x = softcap * (dot * scale / softcap).tanh();
                        if let Some(m) = mask {
                            x += m[i * skv + j];
                        }
                        if causal && j > i {
                            x = f64::NEG_INFINITY;
                        }
                        x
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                s.iter_mut().for_each(|x| *x = (*x - mx).exp());
                let z: f64 = s.iter().sum();
                for t in 0..d {
                    y[((bi * hq + h) * sq + i) * d + t] = (0..skv)
                        .map(|j| s[j] / z * v[((bi * hkv + kh) * skv + j) * d + t])
                        .sum();
                }
            }
        }
    }
    y
}

/// `[a, p, q, d]` with its two middle axes swapped: `[a, q, p, d]`.
fn swap12(x: &[f64], [a, p, q, d]: [usize; 4]) -> Vec<f64> {
    let mut o = vec![0.0; x.len()];
    for i in 0..a {
        for j in 0..p {
            for k in 0..q {
                for t in 0..d {
                    o[((i * q + k) * p + j) * d + t] = x[((i * p + j) * q + k) * d + t];
                }
            }
        }
    }
    o
}

#[test]
fn attention_with_softcap_on_every_backend_with_gradients() {
    let (b, hq, hkv, sq, skv, d) = (2, 4, 2, 3, 5, 4);
    for (causal, masked, three_d) in [
        (false, false, false),
        (true, false, false),
        (false, true, true),
    ] {
        let q = randn(&[b, hq, sq, d], 1);
        let k = randn(&[b, hkv, skv, d], 2);
        let v = randn(&[b, hkv, skv, d], 3);
        let mask = randn(&[sq, skv], 4);
        // 3-D inputs are [B, S, H·D].
        let flat = |t: &Tensor, h: usize, s: usize| -> Tensor {
            Tensor::from_vec(&[b, s, h * d], swap12(&t.to_f64_vec(), [b, h, s, d])).unwrap()
        };
        let (qi, ki, vi) = if three_d {
            (flat(&q, hq, sq), flat(&k, hkv, skv), flat(&v, hkv, skv))
        } else {
            (q.clone(), k.clone(), v.clone())
        };
        let mut ins = vec![("q", Some(qi)), ("k", Some(ki)), ("v", Some(vi))];
        if masked {
            ins.push(("mask", Some(mask.clone())));
        }
        let mut attrs = vec![
            float_attr("softcap", 2.5),
            int_attr("is_causal", causal as i64),
        ];
        if three_d {
            attrs.push(int_attr("q_num_heads", hq as i64));
            attrs.push(int_attr("kv_num_heads", hkv as i64));
        }
        let case = Case::new("Attention", 23, ins).with(attrs);
        let reference = |vals: &[Vec<f64>]| {
            // Back to [B, H, S, D] for the reference, and the output to the inputs' layout.
            let unflat = |x: &[f64], h: usize, s: usize| -> Vec<f64> {
                if three_d {
                    swap12(x, [b, s, h, d])
                } else {
                    x.to_vec()
                }
            };
            let y = softcap_attention_ref(
                &unflat(&vals[0], hq, sq),
                &unflat(&vals[1], hkv, skv),
                &unflat(&vals[2], hkv, skv),
                vals.get(3).map(|m| &m[..]),
                [b, hq, hkv, sq, skv, d],
                2.5,
                causal,
            );
            if three_d {
                let t = Tensor::from_vec(&[b, hq, sq, d], y).unwrap();
                vec![(vec![b, sq, hq * d], flat(&t, hq, sq).to_f64_vec())]
            } else {
                vec![(vec![b, hq, sq, d], y)]
            }
        };
        let what = format!("Attention softcap (causal {causal}, mask {masked}, 3-D {three_d})");
        check_case(&what, &case, &BOTH, 1e-5, reference);
        let wrt: Vec<usize> = if masked {
            vec![0, 1, 2, 3]
        } else {
            vec![0, 1, 2]
        };
        check_grads(&what, &case, &wrt, 5, reference);
    }
}

// ---- the same operators named in a YAML model ----------------------------------------------

/// An attribute written both ways: for the ONNX node and as YAML text.
enum A {
    I(i64),
    Is(&'static [i64]),
    F(f32),
    S(&'static str),
}

fn both(attrs: &[(&'static str, A)]) -> (Vec<AttributeProto>, String) {
    let proto = attrs
        .iter()
        .map(|(k, v)| match v {
            A::I(i) => int_attr(k, *i),
            A::Is(v) => ints_attr(k, v),
            A::F(f) => float_attr(k, *f),
            A::S(s) => str_attr(k, s),
        })
        .collect();
    let yaml: Vec<String> = attrs
        .iter()
        .map(|(k, v)| match v {
            A::I(i) => format!("{k}: {i}"),
            A::Is(v) => format!("{k}: {v:?}"),
            A::F(f) => format!("{k}: {f:?}"),
            A::S(s) => format!("{k}: \"{s}\""),
        })
        .collect();
    (proto, format!("{{{}}}", yaml.join(", ")))
}

/// Each ONNX operator the importer writes as graphrun's ops, named in a YAML model, gives
/// bit for bit what the same node in an `.onnx` file gives (the newest opset's semantics),
/// forward and backward; the YAML inputs have symbolic dims, so the lowering sees only
/// what holds for every size.
#[test]
fn yaml_models_name_the_onnx_operators_the_importer_writes() {
    type Case = (
        &'static str,
        Vec<(&'static str, Vec<usize>)>,
        usize,
        Vec<(&'static str, A)>,
    );
    let cases: Vec<Case> = vec![
        (
            "Conv",
            vec![
                ("x", vec![2, 4, 7, 6]),
                ("w", vec![6, 2, 3, 3]),
                ("b", vec![6]),
            ],
            1,
            vec![
                ("group", A::I(2)),
                ("pads", A::Is(&[1, 0, 1, 2])),
                ("strides", A::Is(&[2, 1])),
            ],
        ),
        (
            "Conv",
            vec![("x", vec![1, 3, 9]), ("w", vec![3, 1, 3])],
            1,
            vec![
                ("group", A::I(3)),
                ("auto_pad", A::S("SAME_UPPER")),
                ("dilations", A::Is(&[2])),
            ],
        ),
        (
            "ConvTranspose",
            vec![("x", vec![1, 2, 4, 3]), ("w", vec![2, 3, 3, 2])],
            1,
            vec![
                ("strides", A::Is(&[2, 2])),
                ("output_padding", A::Is(&[1, 0])),
            ],
        ),
        (
            "MaxPool",
            vec![("x", vec![2, 3, 7, 5])],
            2,
            vec![
                ("kernel_shape", A::Is(&[3, 2])),
                ("ceil_mode", A::I(1)),
                ("strides", A::Is(&[2, 2])),
            ],
        ),
        (
            "AveragePool",
            vec![("x", vec![1, 2, 6, 6])],
            1,
            vec![
                ("kernel_shape", A::Is(&[3, 3])),
                ("pads", A::Is(&[1, 1, 1, 1])),
                ("count_include_pad", A::I(1)),
            ],
        ),
        (
            "GlobalAveragePool",
            vec![("x", vec![2, 3, 4, 5])],
            1,
            vec![],
        ),
        ("GlobalMaxPool", vec![("x", vec![2, 3, 4])], 1, vec![]),
        (
            "BatchNormalization",
            vec![
                ("x", vec![2, 3, 4, 2]),
                ("s", vec![3]),
                ("b", vec![3]),
                ("m", vec![3]),
                ("v", vec![3]),
            ],
            1,
            vec![("epsilon", A::F(1e-3))],
        ),
        (
            "InstanceNormalization",
            vec![("x", vec![2, 3, 5]), ("s", vec![3]), ("b", vec![3])],
            1,
            vec![],
        ),
        (
            "GroupNormalization",
            vec![("x", vec![2, 4, 3]), ("s", vec![4]), ("b", vec![4])],
            1,
            vec![("num_groups", A::I(2))],
        ),
        (
            "DepthToSpace",
            vec![("x", vec![1, 8, 2, 3])],
            1,
            vec![("blocksize", A::I(2)), ("mode", A::S("CRD"))],
        ),
        (
            "LRN",
            vec![("x", vec![2, 5, 3, 3])],
            1,
            vec![("size", A::I(3))],
        ),
        (
            "Sum",
            vec![("a", vec![2, 3]), ("b", vec![3]), ("c", vec![2, 1])],
            1,
            vec![],
        ),
        (
            "Max",
            vec![("a", vec![2, 3]), ("b", vec![3]), ("c", vec![2, 1])],
            1,
            vec![],
        ),
        ("Mean", vec![("a", vec![4])], 1, vec![]),
        (
            "ReduceLogSumExp",
            vec![("x", vec![3, 4])],
            1,
            vec![("keepdims", A::I(0))],
        ),
        (
            "Einsum",
            vec![("a", vec![2, 3, 4]), ("b", vec![2, 4, 5])],
            1,
            vec![("equation", A::S("bij,bjk->bik"))],
        ),
        (
            "Shrink",
            vec![("x", vec![3, 4])],
            1,
            vec![("lambd", A::F(0.3)), ("bias", A::F(0.1))],
        ),
    ];
    for (op, ins, outs, attrs) in cases {
        let (proto_attrs, yaml_attrs) = both(&attrs);
        let in_names: Vec<&str> = ins.iter().map(|(n, _)| *n).collect();
        let out_names: Vec<String> = (0..outs).map(|k| format!("y{k}")).collect();
        let out_refs: Vec<&str> = out_names.iter().map(String::as_str).collect();
        let n = node(op, "", &in_names, &out_refs, proto_attrs);
        let inputs = ins
            .iter()
            .map(|(name, s)| {
                input(
                    name,
                    DType::F64,
                    &s.iter().map(|&d| Some(d)).collect::<Vec<_>>(),
                )
            })
            .collect();
        let from_onnx =
            import_one_node(n, 27, inputs, vec![]).unwrap_or_else(|e| panic!("{op}: {e}"));
        // The YAML model: every input's dims symbolic.
        let yaml_inputs: Vec<String> = ins
            .iter()
            .map(|(name, s)| {
                let dims: Vec<String> = (0..s.len()).map(|k| format!("{name}_{k}")).collect();
                format!(
                    "  - {{name: {name}, dtype: f64, shape: [{}]}}",
                    dims.join(", ")
                )
            })
            .collect();
        let text = format!(
            "graphrun: 1\ninputs:\n{}\noutputs: [{}]\nnodes:\n  - {{op: {op}, inputs: [{}], outputs: [{}], attrs: {yaml_attrs}}}\n",
            yaml_inputs.join("\n"),
            out_names.join(", "),
            in_names.join(", "),
            out_names.join(", "),
        );
        let from_yaml = graphrun::Model::from_str(&text, ".")
            .unwrap_or_else(|e| panic!("{op}: {e}\n{text}"))
            .graph;
        let feeds: HashMap<String, Tensor> = ins
            .iter()
            .enumerate()
            .map(|(k, (name, s))| {
                let t = if *name == "v" {
                    rand(s, 40 + k as u64, 0.5, 2.0)
                } else {
                    rand(s, 40 + k as u64, -1.0, 1.0)
                };
                (name.to_string(), t)
            })
            .collect();
        let run = |g: &graphrun::Graph| {
            let mut s = Session::new(g.clone(), SessionOptions::unfused()).unwrap();
            let b = s
                .backward(&feeds, &HashMap::new())
                .unwrap_or_else(|e| panic!("{op}: {e}"));
            let mut grads = b.grads;
            grads.sort_by(|a, b| a.0.cmp(&b.0));
            (b.outputs, grads)
        };
        let (o1, g1) = run(&from_onnx);
        let (o2, g2) = run(&from_yaml);
        assert_eq!(o1.len(), o2.len(), "{op}");
        for ((n, a), (_, b)) in o1.iter().zip(&o2) {
            assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{op}: output {n}");
        }
        assert_eq!(g1.len(), g2.len(), "{op}");
        for ((n, a), (m, b)) in g1.iter().zip(&g2) {
            assert_eq!(n, m, "{op}");
            assert_eq!(a.to_f64_vec(), b.to_f64_vec(), "{op}: gradient of {n}");
        }
    }
}

/// A lowering's refusal names the YAML node's place; an op neither graphrun nor the
/// importer knows is refused as before.
#[test]
fn yaml_lowering_errors_name_the_place() {
    let text = "graphrun: 1\ninputs:\n  - {name: x, dtype: f32, shape: [1, 2, 5, 5]}\n  - {name: w, dtype: f32, shape: [2, 2, 3, 3]}\noutputs: [y]\nnodes:\n  - {op: Conv, inputs: [x, w], outputs: [y], attrs: {group: 0}}\n";
    let e = graphrun::Model::from_str(text, ".")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("<string>:7:5:"), "{e}");
    assert!(e.contains("group") && e.contains("positive"), "{e}");
    let text = text.replace("op: Conv,", "op: Convolution,");
    let e = graphrun::Model::from_str(&text, ".")
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown op 'Convolution'"), "{e}");
}

// ---- Dropout's training_mode --------------------------------------------------------------

/// A training_mode written as a constant (PyTorch's dynamo exporter writes `true` into
/// eval-mode exports) leaves a plain run as inference, as ONNX Runtime runs the model;
/// fed at run time it decides, as ONNX defines it.
#[test]
fn dropout_training_mode_constant_or_fed() {
    let x = randn(&[4, 16], 3).cast(DType::F32);
    let ratio = Tensor::scalar(0.5f32);
    let yes = bools(&[], &[true]);
    let run = |fed: bool| -> (Vec<f64>, Vec<f64>) {
        let n = node("Dropout", "", &["x", "r", "t"], &["y", "mask"], vec![]);
        let mut inputs = vec![input_like("x", &x)];
        let mut inits = vec![initializer("r", &ratio)];
        if fed {
            inputs.push(input_like("t", &yes));
        } else {
            inits.push(initializer("t", &yes));
        }
        let bytes = model_bytes(vec![n], 22, inputs, inits, &["y", "mask"]);
        let g = graphrun::onnx::from_bytes(&bytes, "model", std::path::Path::new(".")).unwrap();
        let mut s = Session::new(g, SessionOptions::default()).unwrap();
        let mut feeds = HashMap::from([("x".to_string(), x.clone())]);
        if fed {
            feeds.insert("t".to_string(), yes.clone());
        }
        let out = s.run(&feeds).unwrap();
        (out[0].1.to_f64_vec(), out[1].1.to_f64_vec())
    };
    let (y, mask) = run(false);
    assert_eq!(y, x.to_f64_vec(), "constant training_mode: identity");
    assert!(mask.iter().all(|&m| m == 1.0));
    let (y, mask) = run(true);
    let kept = mask.iter().filter(|&&m| m == 1.0).count();
    assert!(
        kept > 0 && kept < mask.len(),
        "fed training_mode: masked ({kept} kept)"
    );
    for (i, (&yv, &xv)) in y.iter().zip(&x.to_f64_vec()).enumerate() {
        assert!((yv - mask[i] * xv * 2.0).abs() < 1e-6, "y[{i}]");
    }
}

// ---- MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv ------------------------------

/// A direct-loop 2-D convolution of x [N, C, H, W] by w [M, C/g, kh, kw] in f64 (no
/// dilation), with stride `s` and symmetric padding `p`; returns Y's shape and values.
fn conv2d_ref(
    x: &[f64],
    xs: [usize; 4],
    w: &[f64],
    ws: [usize; 4],
    g: usize,
    s: usize,
    p: usize,
) -> (Vec<usize>, Vec<f64>) {
    let [n, c, h, wd] = xs;
    let [m, cg, kh, kw] = ws;
    assert_eq!(c, cg * g);
    let (oh, ow) = ((h + 2 * p - kh) / s + 1, (wd + 2 * p - kw) / s + 1);
    let mut y = vec![0.0; n * m * oh * ow];
    for (i, y) in y.iter_mut().enumerate() {
        let (b, o, r, q) = (i / (m * oh * ow), i / (oh * ow) % m, i / ow % oh, i % ow);
        let grp = o / (m / g);
        for ci in 0..cg {
            for (u, v) in (0..kh).flat_map(|u| (0..kw).map(move |v| (u, v))) {
                let (yy, xx) = ((r * s + u) as i64 - p as i64, (q * s + v) as i64 - p as i64);
                if yy < 0 || xx < 0 || yy >= h as i64 || xx >= wd as i64 {
                    continue;
                }
                let xi = ((b * c + grp * cg + ci) * h + yy as usize) * wd + xx as usize;
                *y += x[xi] * w[((o * cg + ci) * kh + u) * kw + v];
            }
        }
    }
    (vec![n, m, oh, ow], y)
}

/// The quantized products against integer references: per-row and per-column zero points
/// and scales, per-filter zero points and per-channel scales, grouped strided padded
/// convolutions, a bias, both 8-bit types, on every backend; the integer outputs exact
/// and the requantized ones rounded half to even and saturated as ONNX's reference does.
#[test]
fn quantized_products_on_every_backend() {
    let ints = |shape: &[usize], seed, lo, hi, dt| rand_ints(shape, seed, lo, hi).cast(dt);
    // MatMulInteger: A u8 [2, 3, 5] (a zero point per row), B i8 [5, 4] (one per column).
    let a = ints(&[2, 3, 5], 700, 0, 256, DType::U8);
    let b = ints(&[5, 4], 701, -128, 128, DType::I8);
    let (azp, bzp) = (
        ints(&[3], 702, 0, 256, DType::U8),
        ints(&[4], 703, -128, 128, DType::I8),
    );
    let case = Case::new(
        "MatMulInteger",
        10,
        vec![
            ("a", Some(a)),
            ("b", Some(b)),
            ("azp", Some(azp)),
            ("bzp", Some(bzp)),
        ],
    );
    let matmul = |v: &[Vec<f64>], rows: usize| -> Vec<f64> {
        (0..v[0].len() / 5 * 4)
            .map(|i| {
                let (r, col) = (i / 4, i % 4);
                (0..5)
                    .map(|k| (v[0][r * 5 + k] - v[2][r % rows]) * (v[1][k * 4 + col] - v[3][col]))
                    .sum()
            })
            .collect()
    };
    check_case("MatMulInteger", &case, &[DType::F32], 0.0, |v| {
        vec![(vec![2, 3, 4], matmul(v, 3))]
    });
    // QLinearMatMul: the same product requantized to i8 (b's scale per column).
    let a = ints(&[3, 5], 710, 0, 256, DType::U8);
    let b = ints(&[5, 4], 711, -128, 128, DType::I8);
    let case = Case::new(
        "QLinearMatMul",
        21,
        vec![
            ("a", Some(a)),
            ("a_scale", Some(Tensor::scalar(0.02f32))),
            ("a_zero_point", Some(Tensor::scalar(120u8))),
            ("b", Some(b)),
            (
                "b_scale",
                Some(Tensor::from_vec(&[4], vec![0.01f32, 0.03, 0.002, 0.05]).unwrap()),
            ),
            ("b_zero_point", Some(ints(&[4], 712, -20, 20, DType::I8))),
            ("y_scale", Some(Tensor::scalar(0.4f32))),
            ("y_zero_point", Some(Tensor::scalar(-3i8))),
        ],
    );
    check_case("QLinearMatMul", &case, &[DType::F32], 0.0, |v| {
        let c = [v[0].clone(), v[3].clone(), vec![v[2][0]; 3], v[5].clone()];
        let y = matmul(&c, 3)
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let scale = v[1][0] as f32 * v[4][i % 4] as f32 / v[6][0] as f32;
                round_even((s as f32 * scale + v[7][0] as f32) as f64).clamp(-128.0, 127.0)
            })
            .collect();
        vec![(vec![3, 4], y)]
    });
    // ConvInteger and QLinearConv: x [2, 4, 5, 6], w [6, 2, 3, 3] in 2 groups, stride 2,
    // padding 1; a zero point per filter.
    let conv_attrs = || {
        vec![
            int_attr("group", 2),
            ints_attr("strides", &[2, 2]),
            ints_attr("pads", &[1, 1, 1, 1]),
            ints_attr("kernel_shape", &[3, 3]),
        ]
    };
    for (k, dt) in [DType::U8, DType::I8].into_iter().enumerate() {
        let seed = 720 + 10 * k as u64;
        let (lo, hi) = if dt == DType::U8 {
            (0, 256)
        } else {
            (-128, 128)
        };
        let x = ints(&[2, 4, 5, 6], seed, lo, hi, dt);
        let w = ints(&[6, 2, 3, 3], seed + 1, lo, hi, dt);
        let xzp = ints(&[], seed + 2, lo, hi, dt);
        let wzp = ints(&[6], seed + 3, lo, hi, dt);
        let conv = |v: &[Vec<f64>], xzp: f64, wzp: &[f64]| {
            let x: Vec<f64> = v[0].iter().map(|x| x - xzp).collect();
            let w: Vec<f64> = v[1]
                .iter()
                .enumerate()
                .map(|(i, w)| w - wzp[i / 18])
                .collect();
            conv2d_ref(&x, [2, 4, 5, 6], &w, [6, 2, 3, 3], 2, 2, 1)
        };
        let case = Case::new(
            "ConvInteger",
            10,
            vec![
                ("x", Some(x.clone())),
                ("w", Some(w.clone())),
                ("xzp", Some(xzp.clone())),
                ("wzp", Some(wzp.clone())),
            ],
        )
        .with(conv_attrs());
        check_case(
            &format!("ConvInteger {dt}"),
            &case,
            &[DType::F32],
            0.0,
            |v| vec![conv(v, v[2][0], &v[3])],
        );
        let bias = ints(&[6], seed + 4, -500, 500, DType::I32);
        let w_scale = rand(&[6], seed + 5, 0.001, 0.01);
        let case = Case::new(
            "QLinearConv",
            10,
            vec![
                ("x", Some(x)),
                ("x_scale", Some(Tensor::scalar(0.05f32))),
                ("x_zero_point", Some(xzp)),
                ("w", Some(w)),
                ("w_scale", Some(w_scale)),
                ("w_zero_point", Some(wzp)),
                ("y_scale", Some(Tensor::scalar(0.3f32))),
                ("y_zero_point", Some(Tensor::scalar(7u8))),
                ("bias", Some(bias)),
            ],
        )
        .with(conv_attrs());
        check_case(
            &format!("QLinearConv {dt}"),
            &case,
            &[DType::F32],
            0.0,
            |v| {
                let (shape, y) = conv(&[v[0].clone(), v[3].clone()], v[2][0], &v[5]);
                let per = shape[2] * shape[3];
                let y = y
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| {
                        let o = i / per % 6;
                        let scale = v[1][0] as f32 * v[4][o] as f32 / v[6][0] as f32;
                        let s = (s + v[8][o]) as f32;
                        round_even((s * scale + v[7][0] as f32) as f64).clamp(0.0, 255.0)
                    })
                    .collect();
                vec![(shape, y)]
            },
        );
    }
}

/// A small model (strided Conv, ReLU, two MatMuls) as ONNX Runtime's quantization tools
/// write it: dynamic (DynamicQuantizeLinear, ConvInteger, MatMulInteger), static QOperator
/// (QLinearConv, QLinearMatMul) and static QDQ; on every backend against ONNX Runtime's
/// output (tests/fixtures/quantized, `python3 scripts/make_quantized.py`). Every product is
/// of integers under 2^24, so the outputs agree to f32 rounding of the rescaling.
#[test]
fn quantized_models_match_onnx_runtime() {
    let dir = std::path::Path::new("tests/fixtures/quantized");
    let img = Tensor::read_npy(&dir.join("img.npy")).unwrap();
    for name in ["dynamic", "qoperator", "qdq"] {
        let want = Tensor::read_npy(&dir.join(format!("{name}.ort.npy"))).unwrap();
        let model = graphrun::Model::load(dir.join(format!("{name}.onnx")))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for backend in backends() {
            for opts in [SessionOptions::unfused(), SessionOptions::default()] {
                let opts = SessionOptions { backend, ..opts };
                let mut s = Session::new(model.graph.clone(), opts).unwrap();
                let got = s
                    .run(&HashMap::from([("img".to_string(), img.clone())]))
                    .unwrap_or_else(|e| panic!("{name} on {backend:?}: {e}"));
                let e = rel_err(&got[0].1.to_f64_vec(), &want.to_f64_vec());
                assert!(e <= 1e-5, "{name} on {backend:?}: rel err {e:.2e}");
            }
        }
    }
}

// ---- LinearAttention ----------------------------------------------------------------------

/// LinearAttention's recurrence in f64, loop by loop: per batch and KV head a state
/// S [d_k, d_v] (from past, else zero), S ·= exp(decay_t) per key row, v_t replaced by
/// beta_t·(v_t − Sᵀk_t), S += k_t v_tᵀ, and each query head of the group reads
/// o_t = scale·q_t S. Returns (output [B, T, Hq·d_v], present state).
#[allow(clippy::too_many_arguments)]
fn linear_attention_ref(
    v: &[Vec<f64>],
    [b, t, hq, hkv, dk, dv]: [usize; 6],
    past: bool,
    decay: Option<usize>,
    beta: Option<usize>,
    scale: f64,
) -> Expected {
    let (q, k, val) = (&v[0], &v[1], &v[2]);
    let g = hq / hkv;
    let mut out = vec![0.0; b * t * hq * dv];
    let mut present = vec![0.0; b * hkv * dk * dv];
    for bi in 0..b {
        for h in 0..hkv {
            let base = (bi * hkv + h) * dk * dv;
            let mut s: Vec<f64> = match past {
                true => v[3][base..base + dk * dv].to_vec(),
                false => vec![0.0; dk * dv],
            };
            for ti in 0..t {
                let kt: Vec<f64> = (0..dk)
                    .map(|d| k[(bi * t + ti) * hkv * dk + h * dk + d])
                    .collect();
                let mut vt: Vec<f64> = (0..dv)
                    .map(|m| val[(bi * t + ti) * hkv * dv + h * dv + m])
                    .collect();
                if let Some(w) = decay {
                    for d in 0..dk {
                        let x = if w == hkv { h } else { h * dk + d };
                        let e = v[4][(bi * t + ti) * w + x].exp();
                        (0..dv).for_each(|m| s[d * dv + m] *= e);
                    }
                }
                if let Some(w) = beta {
                    let bt = v[5][(bi * t + ti) * w + if w == 1 { 0 } else { h }];
                    for (m, x) in vt.iter_mut().enumerate() {
                        let got: f64 = (0..dk).map(|d| s[d * dv + m] * kt[d]).sum();
                        *x = bt * (*x - got);
                    }
                }
                for d in 0..dk {
                    (0..dv).for_each(|m| s[d * dv + m] += kt[d] * vt[m]);
                }
                for gi in 0..g {
                    let qh = h * g + gi;
                    for m in 0..dv {
                        let dot: f64 = (0..dk)
                            .map(|d| q[(bi * t + ti) * hq * dk + qh * dk + d] * s[d * dv + m])
                            .sum();
                        out[(bi * t + ti) * hq * dv + qh * dv + m] = scale * dot;
                    }
                }
            }
            present[base..base + dk * dv].copy_from_slice(&s);
        }
    }
    vec![(vec![b, t, hq * dv], out), (vec![b, hkv, dk, dv], present)]
}

/// LinearAttention's four update rules, grouped query heads, per-head and per-key decay,
/// per-head and shared beta, a past state and an explicit scale, on every backend against
/// the f64 recurrence, and the gradients of every input against its finite differences.
#[test]
fn linear_attention_on_every_backend_with_gradients() {
    struct La {
        rule: &'static str,
        heads: (usize, usize),
        past: bool,
        decay_per_key: bool,
        beta_shared: bool,
        scale: f32,
    }
    let la = |rule, heads, past, decay_per_key, beta_shared, scale| La {
        rule,
        heads,
        past,
        decay_per_key,
        beta_shared,
        scale,
    };
    let cases = [
        la("linear", (2, 2), false, false, false, 0.0),
        la("gated", (4, 2), true, false, false, 0.0),
        la("delta", (2, 1), false, false, true, 0.5),
        la("gated_delta", (4, 2), true, true, false, 0.0),
        la("gated_delta", (2, 2), false, false, true, 0.0),
    ];
    let (b, t, dk, dv) = (2usize, 3usize, 4usize, 3usize);
    for (ci, c) in cases.iter().enumerate() {
        let seed = 900 + 10 * ci as u64;
        let (hq, hkv) = c.heads;
        let gated = c.rule.starts_with("gated");
        let delta = c.rule.ends_with("delta");
        let decay_w = if c.decay_per_key { hkv * dk } else { hkv };
        let beta_w = if c.beta_shared { 1 } else { hkv };
        let opt = |on: bool, t: Tensor| on.then_some(t);
        let inputs = vec![
            ("query", Some(randn(&[b, t, hq * dk], seed))),
            ("key", Some(rand(&[b, t, hkv * dk], seed + 1, -0.6, 0.6))),
            ("value", Some(randn(&[b, t, hkv * dv], seed + 2))),
            (
                "past_state",
                opt(c.past, randn(&[b, hkv, dk, dv], seed + 3)),
            ),
            (
                "decay",
                opt(gated, rand(&[b, t, decay_w], seed + 4, -0.5, 0.0)),
            ),
            (
                "beta",
                opt(delta, rand(&[b, t, beta_w], seed + 5, 0.2, 1.0)),
            ),
        ];
        let names: Vec<&str> = inputs
            .iter()
            .map(|(n, t)| if t.is_some() { *n } else { "" })
            .collect();
        let mut inputs = inputs;
        for (k, n) in names.iter().enumerate() {
            if n.is_empty() {
                inputs[k].0 = "";
            }
        }
        while inputs.last().is_some_and(|(n, _)| n.is_empty()) {
            inputs.pop();
        }
        let mut case = Case::new("LinearAttention", 27, inputs).with(vec![
            int_attr("q_num_heads", hq as i64),
            int_attr("kv_num_heads", hkv as i64),
            str_attr("update_rule", c.rule),
            float_attr("scale", c.scale),
        ]);
        case.outputs = vec!["output", "present_state"];
        let scale = if c.scale == 0.0 {
            1.0 / (dk as f64).sqrt()
        } else {
            c.scale as f64
        };
        let reference = |v: &[Vec<f64>]| {
            let mut v = v.to_vec();
            v.resize(6, vec![]);
            linear_attention_ref(
                &v,
                [b, t, hq, hkv, dk, dv],
                c.past,
                gated.then_some(decay_w),
                delta.then_some(beta_w),
                scale,
            )
        };
        let what = format!(
            "LinearAttention {} heads {hq}/{hkv} past {}",
            c.rule, c.past
        );
        check_case(&what, &case, &BOTH, 1e-5, reference);
        let wrt: Vec<usize> = (0..case.inputs.len())
            .filter(|&k| case.inputs[k].1.is_some())
            .collect();
        // Unseeded outputs take seeds of ones: differentiate the output alone.
        let mut alone = case.clone();
        alone.outputs = vec!["output"];
        check_grads(&what, &alone, &wrt, seed, reference);
    }
}

// ---- Bernoulli and Multinomial --------------------------------------------------------------

/// Runs `g` (input `x`) on every backend that has `out`'s type; the outputs, which must
/// agree across backends bit for bit (the draws are the same, compared in the input's
/// type), and each backend with its output.
fn sampled_everywhere(g: &graphrun::Graph, x: &Tensor, out: DType) -> Vec<f64> {
    let feeds = HashMap::from([("x".to_string(), x.clone())]);
    let mut first: Option<Vec<f64>> = None;
    for backend in backends() {
        if graphrun::backends::not_on(backend, out) {
            continue;
        }
        let opts = SessionOptions {
            backend,
            ..SessionOptions::unfused()
        };
        let got = Session::new(g.clone(), opts)
            .and_then(|mut s| s.run(&feeds))
            .unwrap_or_else(|e| panic!("{} on {backend:?}: {e}", g.name));
        let y = &got[0].1;
        assert_eq!(y.dtype(), out, "{} on {backend:?}", g.name);
        let v = y.to_f64_vec();
        match &first {
            None => first = Some(v),
            Some(f) => assert!(f == &v, "{} on {backend:?} differs from the CPU", g.name),
        }
    }
    first.unwrap()
}

#[test]
fn bernoulli_draws_ones_with_probability_p_on_every_backend() {
    let ps = [0.0, 0.05, 0.2, 0.5, 0.7, 0.9, 0.99, 1.0];
    let rows = 4000;
    let p: Vec<f64> = (0..rows * 8).map(|i| ps[i % 8]).collect();
    let p = Tensor::from_vec(&[rows, 8], p).unwrap().cast(DType::F32);
    for (dtype, out) in [
        (None, DType::F32),
        (Some(7), DType::I64),
        (Some(9), DType::Bool),
    ] {
        let mut attrs = vec![float_attr("seed", 2.0)];
        attrs.extend(dtype.map(|d| int_attr("dtype", d)));
        let n = node("Bernoulli", "", &["x"], &["y"], attrs);
        let x = input("x", DType::F32, &[Some(rows), Some(8)]);
        let mut g = import_one_node(n, 15, vec![x], vec![]).unwrap();
        g.name = format!("Bernoulli to {out}");
        let y = sampled_everywhere(&g, &p, out);
        for (c, &pc) in ps.iter().enumerate() {
            let col: Vec<f64> = y.iter().skip(c).step_by(8).copied().collect();
            assert!(
                col.iter().all(|&v| v == 0.0 || v == 1.0),
                "{}: not 0 or 1",
                g.name
            );
            let mean = col.iter().sum::<f64>() / rows as f64;
            let sd = (pc * (1.0 - pc) / rows as f64).sqrt();
            assert!(
                (mean - pc).abs() <= 5.0 * sd,
                "{}: p = {pc} drew ones at rate {mean}",
                g.name
            );
        }
    }
}

#[test]
fn multinomial_samples_classes_by_their_probabilities_on_every_backend() {
    // Unnormalized log-probabilities: the classes' probabilities are their softmax.
    let logits: [[f64; 4]; 3] = [[5.0, -1.0, 0.5, 2.0], [0.0; 4], [-30.0, 1.0, -30.0, 1.0]];
    let x = Tensor::from_vec(&[3, 4], logits.concat())
        .unwrap()
        .cast(DType::F32);
    let samples = 20_000;
    for (dtype, out) in [(None, DType::I32), (Some(7), DType::I64)] {
        let mut attrs = vec![
            int_attr("sample_size", samples as i64),
            float_attr("seed", 9.0),
        ];
        attrs.extend(dtype.map(|d| int_attr("dtype", d)));
        let n = node("Multinomial", "", &["x"], &["y"], attrs);
        let mut g =
            import_one_node(n, 7, vec![input("x", DType::F32, &[None, Some(4)])], vec![]).unwrap();
        g.name = format!("Multinomial to {out}");
        let y = sampled_everywhere(&g, &x, out);
        assert_eq!(y.len(), 3 * samples);
        for (r, row) in logits.iter().enumerate() {
            let z: f64 = row.iter().map(|v| v.exp()).sum();
            let drawn = &y[r * samples..(r + 1) * samples];
            for (c, v) in row.iter().enumerate() {
                let p = v.exp() / z;
                let f = drawn.iter().filter(|&&k| k == c as f64).count() as f64 / samples as f64;
                let sd = (p * (1.0 - p) / samples as f64).sqrt();
                assert!(
                    (f - p).abs() <= 5.0 * sd + 1e-9,
                    "{}: row {r} class {c} drawn at rate {f}, want {p}",
                    g.name
                );
            }
        }
    }
    // Refusals name the node and the attribute.
    let bad = |attrs, dims: &[Option<usize>]| {
        let n = node("Multinomial", "", &["x"], &["y"], attrs);
        import_one_node(n, 7, vec![input("x", DType::F32, dims)], vec![])
            .unwrap_err()
            .to_string()
    };
    let e = bad(vec![int_attr("sample_size", 0)], &[Some(2), Some(3)]);
    assert!(
        e.contains("(Multinomial)") && e.contains("'sample_size' must be positive"),
        "{e}"
    );
    let e = bad(vec![int_attr("dtype", 1)], &[Some(2), Some(3)]);
    assert!(e.contains("'dtype' must be int32 or int64, got f32"), "{e}");
    let e = bad(vec![], &[Some(2), Some(3), Some(4)]);
    assert!(
        e.contains("must be 2-D ([batch, classes]), got rank 3"),
        "{e}"
    );
}

// ---- TfIdfVectorizer ----------------------------------------------------------------------

/// ONNX's reference walk: for every skip distance d and start s, the items X[s], X[s+d],
/// ... are followed through the pool's n-grams (and their prefixes) up to max_gram_length;
/// each n-gram of at least the starting length that the walk passes is counted (its last
/// place in the pool when it is repeated). Unigrams count at distance 1 only.
#[allow(clippy::too_many_arguments)]
fn tfidf_ref(
    x: &[i64],
    rows: usize,
    pool: &[i64],
    counts: &[i64],
    indexes: &[i64],
    (min, max, skip): (usize, usize, usize),
    mode: &str,
    weights: &[f64],
) -> Vec<f64> {
    let mut ids: HashMap<Vec<i64>, usize> = HashMap::new();
    let mut prefixes: std::collections::HashSet<Vec<i64>> = Default::default();
    let mut id = 0;
    for (i, &start) in counts.iter().enumerate() {
        let end = counts.get(i + 1).copied().unwrap_or(pool.len() as i64) as usize;
        for g in pool[start as usize..end].chunks(i + 1) {
            for k in 1..=g.len() {
                prefixes.insert(g[..k].to_vec());
            }
            if (min..=max).contains(&g.len()) {
                ids.insert(g.to_vec(), id);
            }
            id += 1;
        }
    }
    let width = *indexes.iter().max().unwrap() as usize + 1;
    let c = x.len() / rows;
    let mut f = vec![0f64; rows * width];
    for r in 0..rows {
        let row = &x[r * c..(r + 1) * c];
        let mut start_len = min;
        for d in 1..=skip + 1 {
            for s in 0..c {
                let mut walk = vec![];
                let mut at = s;
                while walk.len() < max && at < c {
                    walk.push(row[at]);
                    if !prefixes.contains(&walk) {
                        break;
                    }
                    if walk.len() >= start_len {
                        if let Some(&g) = ids.get(&walk) {
                            f[r * width + indexes[g] as usize] += 1.0;
                        }
                    }
                    at += d;
                }
            }
            if start_len == 1 {
                start_len = 2;
                if start_len > max {
                    break;
                }
            }
        }
    }
    let w = |i: usize| {
        if weights.is_empty() {
            1.0
        } else {
            weights[i % width]
        }
    };
    f.iter()
        .enumerate()
        .map(|(i, &v)| match mode {
            "TF" => v,
            "IDF" => (v > 0.0) as u8 as f64 * w(i),
            _ => v * w(i),
        })
        .collect()
}

#[test]
fn tfidf_vectorizer_counts_ngrams_with_skips_on_every_backend() {
    // Unigrams 1, 3, 2, 1 (repeated: its later place counts), bigrams (1,2), (3,3), (2,1),
    // trigrams (1,2,3), (2,2,2).
    let pool = [1i64, 3, 2, 1, 1, 2, 3, 3, 2, 1, 1, 2, 3, 2, 2, 2];
    let counts = [0i64, 4, 10];
    let indexes = [0i64, 1, 2, 3, 4, 5, 6, 7, 8];
    let settings = [
        (1usize, 1usize, 0usize),
        (1, 2, 0),
        (2, 2, 3),
        (1, 3, 2),
        (3, 3, 1),
        (2, 3, 0),
    ];
    let mut seed = 0;
    for (min, max, skip) in settings {
        for mode in ["TF", "IDF", "TFIDF"] {
            for weighted in [false, true] {
                for (shape, dt) in [(vec![3usize, 11], DType::I64), (vec![13], DType::I32)] {
                    seed += 1;
                    let x = rand_ints(&shape, seed, 0, 4);
                    let rows = if shape.len() == 2 { shape[0] } else { 1 };
                    let weights: Vec<f64> = if weighted {
                        (0..9).map(|i| 0.5 + i as f64 * 0.25).collect()
                    } else {
                        vec![]
                    };
                    let mut attrs = vec![
                        int_attr("min_gram_length", min as i64),
                        int_attr("max_gram_length", max as i64),
                        int_attr("max_skip_count", skip as i64),
                        str_attr("mode", mode),
                        ints_attr("ngram_counts", &counts),
                        ints_attr("ngram_indexes", &indexes),
                        ints_attr("pool_int64s", &pool),
                    ];
                    if weighted {
                        let w: Vec<f32> = weights.iter().map(|&v| v as f32).collect();
                        attrs.push(floats_attr("weights", &w));
                    }
                    let case =
                        Case::new("TfIdfVectorizer", 9, vec![("x", Some(x.cast(dt)))]).with(attrs);
                    let want = tfidf_ref(
                        &x.to_i64_vec(),
                        rows,
                        &pool,
                        &counts,
                        &indexes,
                        (min, max, skip),
                        mode,
                        &weights,
                    );
                    let out_shape = if shape.len() == 2 {
                        vec![rows, 9]
                    } else {
                        vec![9]
                    };
                    let what = format!(
                        "TfIdfVectorizer {mode} grams {min}..={max} skip {skip} weighted {weighted} {shape:?} {dt}"
                    );
                    check_case(&what, &case, &[DType::F32], 1e-6, |_| {
                        vec![(out_shape.clone(), want.clone())]
                    });
                }
            }
        }
    }
}

#[test]
fn tfidf_vectorizer_refusals_name_the_attribute() {
    let base = || {
        vec![
            int_attr("min_gram_length", 1),
            int_attr("max_gram_length", 2),
            int_attr("max_skip_count", 0),
            str_attr("mode", "TF"),
            ints_attr("ngram_counts", &[0, 2]),
            ints_attr("ngram_indexes", &[0, 1, 2]),
        ]
    };
    let import = |attrs: Vec<AttributeProto>| {
        let n = node("TfIdfVectorizer", "", &["x"], &["y"], attrs);
        import_one_node(
            n,
            9,
            vec![input("x", DType::I64, &[Some(2), Some(5)])],
            vec![],
        )
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    let mut strings = base();
    strings.push(strs_attr("pool_strings", &["a", "b", "a", "b"]));
    let e = import(strings);
    assert!(e.contains("pool_strings") && e.contains("string"), "{e}");
    let mut bad_mode = base();
    bad_mode.push(ints_attr("pool_int64s", &[1, 2, 1, 2]));
    bad_mode[3] = str_attr("mode", "BM25");
    let e = import(bad_mode);
    assert!(e.contains("'mode'") && e.contains("BM25"), "{e}");
    let mut odd = base();
    odd.push(ints_attr("pool_int64s", &[1, 2, 1]));
    let e = import(odd);
    assert!(e.contains("2-grams") && e.contains("multiple of 2"), "{e}");
    // An output column far out: refused by size, not an abort allocating it.
    let mut far = base();
    far[5] = ints_attr("ngram_indexes", &[0, 1 << 40, 2]);
    far.push(ints_attr("pool_int64s", &[1, 2, 1, 2]));
    let e = import(far);
    assert!(e.contains("memory limit"), "{e}");
}

// ---- MelWeightMatrix ----------------------------------------------------------------------

/// ONNX's reference, in f64.
fn mel_ref(mels: usize, dft: usize, rate: f64, lo: f64, hi: f64) -> Vec<f64> {
    let nspec = dft / 2 + 1;
    let to_mel = |f: f64| 2595.0 * (1.0 + f / 700.0).log10();
    let (lm, hm) = (to_mel(lo), to_mel(hi));
    let step = (hm - lm) / (mels + 2) as f64;
    let bins: Vec<i64> = (0..mels + 2)
        .map(|k| {
            let hz = 700.0 * (10f64.powf((k as f64 * step + lm) / 2595.0) - 1.0);
            ((dft as f64 + 1.0) * hz / rate).floor() as i64
        })
        .collect();
    let mut out = vec![0f64; nspec * mels];
    let mut set = |j: i64, i: usize, v: f64| {
        if (0..nspec as i64).contains(&j) {
            out[j as usize * mels + i] = v;
        }
    };
    for i in 0..mels {
        let (l, c, h) = (bins[i], bins[i + 1], bins[i + 2]);
        if c == l {
            set(c, i, 1.0);
        } else {
            for j in l..=c {
                set(j, i, (j - l) as f64 / (c - l) as f64);
            }
        }
        if h > c {
            for j in c..h {
                set(j, i, (h - j) as f64 / (h - c) as f64);
            }
        }
    }
    out
}

#[test]
fn mel_weight_matrix_matches_the_reference_on_every_backend() {
    for (mels, dft, rate, lo, hi) in [
        (8usize, 16usize, 8192i64, 0.0f32, 4096.0f32),
        (10, 64, 16000, 20.0, 8000.0),
        (5, 31, 22050, 300.0, 5000.0),
        (40, 400, 16000, 0.0, 8000.0),
    ] {
        for out_dt in [DType::F32, DType::F64] {
            let case = Case::new(
                "MelWeightMatrix",
                17,
                vec![
                    ("mels", Some(i64s(&[], &[mels as i64]))),
                    ("dft", Some(i64s(&[], &[dft as i64]))),
                    ("rate", Some(i64s(&[], &[rate]).cast(DType::I32))),
                    ("lo", Some(Tensor::scalar(lo))),
                    ("hi", Some(Tensor::scalar(hi))),
                ],
            )
            .with(vec![int_attr("output_datatype", elem_type(out_dt) as i64)]);
            let want = mel_ref(mels, dft, rate as f64, lo as f64, hi as f64);
            let shape = vec![dft / 2 + 1, mels];
            let what =
                format!("MelWeightMatrix {mels} bins dft {dft} rate {rate} {lo}..{hi} to {out_dt}");
            // Band edges are computed in f64, which WebGPU lacks; fed at run time, they
            // run on the backends that have it (a model's constant ones fold on the host).
            for backend in backends() {
                if !computes(backend, DType::F64) {
                    continue;
                }
                let got = case.run_on(&case.graph(DType::F32), backend, DType::F32, &what);
                assert_eq!(got[0].1.dtype(), out_dt, "{what} on {backend:?}");
                assert_outputs(
                    &format!("{what} on {backend:?}"),
                    &got,
                    &vec![(shape.clone(), want.clone())],
                    out_dt,
                    1e-6,
                );
            }
            // The same inputs as initializers: the matrix is folded when the model is
            // loaded, so every backend runs it.
            let names = ["mels", "dft", "rate", "lo", "hi"];
            let inits = names
                .iter()
                .zip(case.args(DType::F32))
                .map(|(n, t)| initializer(n, &t.unwrap()))
                .collect();
            let n = node("MelWeightMatrix", "", &names, &["y"], case.attrs.clone());
            let g = import_one_node(n, 17, vec![], inits).unwrap();
            for backend in backends() {
                let opts = SessionOptions {
                    backend,
                    ..SessionOptions::default()
                };
                let got = Session::new(g.clone(), opts)
                    .and_then(|mut s| s.run(&HashMap::new()))
                    .unwrap_or_else(|e| panic!("{what}, constant, on {backend:?}: {e}"));
                if computes(backend, out_dt) {
                    assert_outputs(
                        &format!("{what}, constant, on {backend:?}"),
                        &got,
                        &vec![(shape.clone(), want.clone())],
                        out_dt,
                        1e-6,
                    );
                }
            }
        }
    }
}

// ---- TreeEnsemble (ai.onnx.ml) -------------------------------------------------------------

/// A random ensemble in TreeEnsemble's attributes: `trees` trees of depth up to 3 over
/// `features` features, every mode (set membership included), some nodes sending missing
/// values to the true branch, leaves on random targets.
struct Ensemble {
    splits: Vec<f64>,
    features: Vec<i64>,
    modes: Vec<i64>,
    true_ids: Vec<i64>,
    false_ids: Vec<i64>,
    true_leaf: Vec<i64>,
    false_leaf: Vec<i64>,
    missing: Vec<i64>,
    members: Vec<f64>,
    leaf_targets: Vec<i64>,
    leaf_weights: Vec<f64>,
    roots: Vec<i64>,
}

impl Ensemble {
    fn random(seed: u64, trees: usize, features: usize, targets: usize) -> Ensemble {
        let mut r = graphrun::rng::Rng::new(seed);
        let mut e = Ensemble {
            splits: vec![],
            features: vec![],
            modes: vec![],
            true_ids: vec![],
            false_ids: vec![],
            true_leaf: vec![],
            false_leaf: vec![],
            missing: vec![],
            members: vec![],
            leaf_targets: vec![],
            leaf_weights: vec![],
            roots: vec![],
        };
        // Nodes are numbered as they are made, depth first; the membership sets are
        // listed in node order, as the definition gives them.
        fn grow(
            e: &mut Ensemble,
            r: &mut graphrun::rng::Rng,
            depth: usize,
            f: usize,
            t: usize,
        ) -> (i64, bool) {
            if depth == 0 || r.uniform_in(0.0, 1.0) < 0.2 {
                e.leaf_targets.push(r.int_in(0, t as i64));
                e.leaf_weights
                    .push((r.uniform_in(-4.0, 4.0) * 4.0).round() / 4.0);
                return (e.leaf_weights.len() as i64 - 1, true);
            }
            let id = e.modes.len();
            let mode = r.int_in(0, 7);
            e.modes.push(mode);
            e.features.push(r.int_in(0, f as i64));
            // Splits on the grid the features are drawn from, so that ties happen.
            e.splits.push(if mode == 6 {
                0.0
            } else {
                r.int_in(-2, 3) as f64 * 0.5
            });
            e.missing.push(r.int_in(0, 2));
            if mode == 6 {
                let k = r.int_in(1, 4);
                for _ in 0..k {
                    e.members.push(r.int_in(-2, 3) as f64 * 0.5);
                }
                e.members.push(f64::NAN);
            }
            for v in [
                &mut e.true_ids,
                &mut e.false_ids,
                &mut e.true_leaf,
                &mut e.false_leaf,
            ] {
                v.push(0);
            }
            let (tid, tl) = grow(e, r, depth - 1, f, t);
            e.true_ids[id] = tid;
            e.true_leaf[id] = tl as i64;
            let (fid, fl) = grow(e, r, depth - 1, f, t);
            e.false_ids[id] = fid;
            e.false_leaf[id] = fl as i64;
            (id as i64, false)
        }
        for _ in 0..trees {
            let (root, leaf) = grow(&mut e, &mut r, 3, features, targets);
            if leaf {
                // A one-leaf tree: a node whose branches are both that leaf.
                let id = e.modes.len();
                e.modes.push(0);
                e.features.push(0);
                e.splits.push(0.0);
                e.missing.push(0);
                e.true_ids.push(root);
                e.false_ids.push(root);
                e.true_leaf.push(1);
                e.false_leaf.push(1);
                e.roots.push(id as i64);
            } else {
                e.roots.push(root);
            }
        }
        e
    }

    /// The leaf sample x reaches from node `id` (a leaf when `leaf`), as the reference
    /// walks it.
    fn leaf(
        &self,
        x: &[f64],
        mut id: usize,
        mut leaf: bool,
        sets: &HashMap<usize, Vec<f64>>,
    ) -> usize {
        while !leaf {
            let v = x[self.features[id] as usize];
            let s = self.splits[id];
            let go = match self.modes[id] {
                0 => v <= s,
                1 => v < s,
                2 => v >= s,
                3 => v > s,
                4 => v == s,
                5 => v != s,
                _ => sets[&id].contains(&v),
            } || (self.missing[id] != 0 && v.is_nan());
            (id, leaf) = if go {
                (self.true_ids[id] as usize, self.true_leaf[id] != 0)
            } else {
                (self.false_ids[id] as usize, self.false_leaf[id] != 0)
            };
        }
        id
    }

    fn predict(
        &self,
        x: &[f64],
        rows: usize,
        targets: usize,
        aggregate: i64,
        post: i64,
    ) -> Vec<f64> {
        // The sets in node order (the order they were made, which is the walk's).
        let mut sets = HashMap::new();
        let mut it = self.members.iter();
        for (id, &m) in self.modes.iter().enumerate() {
            if m == 6 {
                let set: Vec<f64> = it.by_ref().take_while(|v| !v.is_nan()).copied().collect();
                sets.insert(id, set);
            }
        }
        let f = x.len() / rows;
        let mut out = vec![];
        for row in x.chunks(f) {
            let init = match aggregate {
                2 => f32::MAX as f64,
                3 => f32::MIN as f64,
                _ => 0.0,
            };
            let mut y = vec![init; targets];
            for &root in &self.roots {
                let root = root as usize;
                let one = self.true_leaf[root] != 0
                    && self.false_leaf[root] != 0
                    && self.true_ids[root] == self.false_ids[root];
                let l = if one {
                    self.true_ids[root] as usize
                } else {
                    self.leaf(row, root, false, &sets)
                };
                let (w, t) = (self.leaf_weights[l], self.leaf_targets[l] as usize);
                y[t] = match aggregate {
                    0 => y[t] + w / self.roots.len() as f64,
                    1 => y[t] + w,
                    2 => y[t].min(w),
                    _ => y[t].max(w),
                };
            }
            match post {
                1 | 3 => {
                    let keep = |v: f64| post == 1 || v != 0.0;
                    let m = y
                        .iter()
                        .copied()
                        .filter(|&v| keep(v))
                        .fold(f64::MIN, f64::max);
                    let e: Vec<f64> = y
                        .iter()
                        .map(|&v| if keep(v) { (v - m).exp() } else { 0.0 })
                        .collect();
                    let s: f64 = e.iter().sum();
                    y = e.iter().map(|v| v / s).collect();
                }
                2 => y.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
                _ => {}
            }
            out.extend(y);
        }
        out
    }

    fn attrs(&self, targets: usize, aggregate: i64, post: i64) -> Vec<AttributeProto> {
        let f32s = |v: &[f64]| {
            Tensor::from_vec(&[v.len()], v.iter().map(|&x| x as f32).collect::<Vec<_>>()).unwrap()
        };
        let modes = Tensor::from_vec(
            &[self.modes.len()],
            self.modes.iter().map(|&m| m as u8).collect::<Vec<_>>(),
        )
        .unwrap();
        let mut a = vec![
            int_attr("n_targets", targets as i64),
            int_attr("aggregate_function", aggregate),
            int_attr("post_transform", post),
            tensor_attr("nodes_splits", &f32s(&self.splits)),
            ints_attr("nodes_featureids", &self.features),
            tensor_attr("nodes_modes", &modes),
            ints_attr("nodes_truenodeids", &self.true_ids),
            ints_attr("nodes_falsenodeids", &self.false_ids),
            ints_attr("nodes_trueleafs", &self.true_leaf),
            ints_attr("nodes_falseleafs", &self.false_leaf),
            ints_attr("nodes_missing_value_tracks_true", &self.missing),
            ints_attr("leaf_targetids", &self.leaf_targets),
            tensor_attr("leaf_weights", &f32s(&self.leaf_weights)),
            ints_attr("tree_roots", &self.roots),
        ];
        if !self.members.is_empty() {
            a.push(tensor_attr("membership_values", &f32s(&self.members)));
        }
        a
    }
}

#[test]
fn tree_ensemble_on_every_backend() {
    let (rows, features, targets) = (40usize, 3usize, 3usize);
    for seed in 0..6u64 {
        let e = Ensemble::random(seed, 2 + seed as usize, features, targets);
        // Features on a half-step grid (ties with the splits and the sets), some NaN.
        let mut r = graphrun::rng::Rng::new(100 + seed);
        let x: Vec<f64> = (0..rows * features)
            .map(|_| match r.int_in(0, 8) {
                0 => f64::NAN,
                _ => r.int_in(-3, 4) as f64 * 0.5,
            })
            .collect();
        for aggregate in 0..4 {
            for post in 0..4 {
                let case = Case {
                    domain: "ai.onnx.ml",
                    ..Case::new(
                        "TreeEnsemble",
                        21,
                        vec![("x", Some(f64s(&[rows, features], &x)))],
                    )
                }
                .with(e.attrs(targets, aggregate, post));
                let want = e.predict(&x, rows, targets, aggregate, post);
                let what = format!("TreeEnsemble seed {seed} aggregate {aggregate} post {post}");
                check_case(&what, &case, &[DType::F32], 1e-6, |_| {
                    vec![(vec![rows, targets], want.clone())]
                });
            }
        }
    }
}

#[test]
fn tree_ensemble_refuses_probit_and_malformed_trees() {
    let e = Ensemble::random(3, 2, 2, 2);
    let import = |attrs: Vec<AttributeProto>| {
        let n = node("TreeEnsemble", "ai.onnx.ml", &["x"], &["y"], attrs);
        import_one_node(
            n,
            21,
            vec![input("x", DType::F32, &[Some(4), Some(2)])],
            vec![],
        )
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    let err = import(e.attrs(2, 1, 4));
    assert!(
        err.contains("post_transform") && err.contains("PROBIT"),
        "{err}"
    );
    let mut cyclic = e.attrs(2, 1, 0);
    let n = e.modes.len() as i64;
    // Node 0's true branch back to itself.
    for a in cyclic.iter_mut() {
        if a.name == "nodes_truenodeids" {
            a.ints[0] = 0;
        }
        if a.name == "nodes_trueleafs" {
            a.ints[0] = 0;
        }
    }
    let err = import(cyclic);
    assert!(err.contains("cycle") || err.contains("unfold"), "{err}");
    let mut short = e.attrs(2, 1, 0);
    for a in short.iter_mut() {
        if a.name == "nodes_featureids" {
            a.ints.pop();
        }
    }
    let err = import(short);
    assert!(
        err.contains("nodes_featureids") && err.contains(&format!("for {n} nodes")),
        "{err}"
    );
    // Targets far out: refused by size, not an abort allocating them.
    let mut huge = e.attrs(2, 1, 0);
    for a in huge.iter_mut() {
        if a.name == "n_targets" {
            a.i = 1 << 40;
        }
    }
    let err = import(huge);
    assert!(err.contains("memory limit"), "{err}");
}

// ---- Cast to FLOAT8E8M0: round_mode and saturate ------------------------------------------

/// ONNX's reference (`onnx.numpy_helper.to_float8e8m0`): x rounded to f32, its exponent
/// bits, raised by one as `round` says, held at 0xfe (`saturate`) or let reach 0xff (NaN).
fn e8m0_ref(x: f64, round: &str, saturate: bool) -> u8 {
    let b = (x as f32).to_bits();
    let e = (b >> 23) & 0xff;
    if e == 0xff {
        return 0xff;
    }
    let up = match round {
        "up" => b & 0x7f_ffff != 0,
        "down" => false,
        _ => {
            let (g, r, s) = (b & 0x40_0000 != 0, b & 0x20_0000 != 0, b & 0x1f_ffff != 0);
            g && (r || s || e > 0)
        }
    };
    if up && saturate && e == 0xfe {
        return 0xfe;
    }
    (e + up as u32).min(0xff) as u8
}

#[test]
fn cast_to_e8m0_rounds_as_round_mode_says_on_every_backend() {
    let two = |k: i32| 2f64.powi(k);
    let mut xs: Vec<f64> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        1.5,
        1.5000001,
        1.4999999,
        1.75,
        1.25,
        3.0,
        -6.0,
        0.124,
        0.75,
        two(-126),
        two(-127),
        two(-127) * 1.5,
        two(-128),
        two(-128) * 1.5,
        two(-140),
        two(127),
        two(127) * 1.5,
        two(127) * 1.25,
        f64::from(f32::MAX),
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
    ];
    let mut r = graphrun::rng::Rng::new(7);
    xs.extend((0..40).map(|_| r.normal() * two(r.int_in(-130, 128) as i32)));
    for round in ["up", "down", "nearest"] {
        for saturate in [1i64, 0] {
            for dt in [DType::F32, DType::F16, DType::F64] {
                let x = Tensor::from_vec(&[xs.len()], xs.clone()).unwrap().cast(dt);
                let want: Vec<u8> = x
                    .to_f64_vec()
                    .iter()
                    .map(|&v| e8m0_ref(v, round, saturate == 1))
                    .collect();
                let case = Case::new("Cast", 25, vec![("x", Some(x.clone()))]).with(vec![
                    int_attr("to", elem_type(DType::F8E8M0) as i64),
                    int_attr("saturate", saturate),
                    str_attr("round_mode", round),
                ]);
                let g = case.graph(dt);
                for backend in backends() {
                    if !computes(backend, dt) {
                        continue;
                    }
                    let what = format!(
                        "Cast {dt} to f8e8m0 round {round} saturate {saturate} on {backend:?}"
                    );
                    let got = case.run_on(&g, backend, dt, &what);
                    let y = &got[0].1;
                    assert_eq!(y.dtype(), DType::F8E8M0, "{what}");
                    for (i, (&g, &w)) in y.bytes().iter().zip(&want).enumerate() {
                        assert_eq!(g, w, "{what}: element {i} ({})", x.to_f64_vec()[i]);
                    }
                }
            }
        }
    }
}

// ---- SplitToSequence with its sizes fed -----------------------------------------------------

/// A 1-D `split` fed at run time: its declared length is the number of elements, and the
/// sizes are read when the plan is made (one plan per distinct sizes).
#[test]
fn split_to_sequence_with_sizes_fed_at_run_time() {
    let x = rand(&[6, 3], 5, -1.0, 1.0);
    for sizes in [[1i64, 3, 2], [2, 2, 2], [0, 6, 0]] {
        let case = Case::new(
            "SplitToSequence",
            11,
            vec![("x", Some(x.clone())), ("split", Some(i64s(&[3], &sizes)))],
        )
        .with(vec![int_attr("axis", 0)]);
        let what = format!("SplitToSequence sizes {sizes:?}");
        check_case(&what, &case, &[DType::F32, DType::F64], 1e-7, |v| {
            let mut start = 0;
            sizes
                .iter()
                .map(|&k| {
                    let k = k as usize;
                    let part = v[0][start * 3..(start + k) * 3].to_vec();
                    start += k;
                    (vec![k, 3], part)
                })
                .collect()
        });
    }
    // Sizes that do not add up to the axis are refused when the plan is made.
    let case = Case::new(
        "SplitToSequence",
        11,
        vec![
            ("x", Some(x.clone())),
            ("split", Some(i64s(&[3], &[1, 1, 1]))),
        ],
    )
    .with(vec![int_attr("axis", 0)]);
    let mut s = Session::new(case.graph(DType::F32), SessionOptions::unfused()).unwrap();
    let e = s
        .run(&case.feeds(&case.args(DType::F32)))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("Split") && e.contains("6"), "{e}");
}
