//! The wgpu row reductions (shaders/reduce.wgsl wg_sum / wg_max) with subgroup operations
//! and with the workgroup-memory tree: both must match the CPU backend, keep NaN and −∞
//! rows as the CPU does, and rerun bit for bit. One test in its own binary because it
//! switches the process-wide choice (`set_subgroups`) between runs.

// It calls the wgpu backend's own functions, which a build without the `wgpu` feature
// does not have.
#![cfg(feature = "wgpu")]

mod common;
use common::*;
use graphrun::graph::op::AttrValue as A;
use graphrun::{BackendKind, DType, Tensor};

/// Rows of `n` seeded values; row 1 holds a NaN, row 2 is all −∞, row 3 has one −∞,
/// row 5 one +∞ (a NaN row for Softmax, as on the CPU).
fn rows(n: usize, seed: u64) -> Tensor {
    let r = 6;
    let mut v = randn(&[r, n], seed).to_f64_vec();
    v[n + (seed as usize * 7) % n] = f64::NAN;
    v[2 * n..3 * n].fill(f64::NEG_INFINITY);
    v[3 * n + n / 2] = f64::NEG_INFINITY;
    v[5 * n + (seed as usize * 3) % n] = f64::INFINITY;
    f64s(&[r, n], &v)
}

/// An op, its attributes, and whether it takes scale and bias inputs.
type Case = (&'static str, Vec<(&'static str, A)>, bool);

fn same_bits(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

#[test]
fn row_reductions_with_and_without_subgroups_match_cpu_and_rerun_exactly() {
    if !wgpu_present() {
        return;
    }
    eprintln!("wgpu: {:?}", graphrun::backends::wgpu::doctor_lines());
    // Around and across the subgroup sizes (8 on lavapipe, 32 on NVIDIA) and the
    // workgroup of 256; 70000 takes the two-pass split reduction.
    let sizes = [1, 7, 8, 9, 33, 255, 256, 300, 1000, 4099];
    let cases: [Case; 6] = [
        ("Softmax", vec![("axis", A::Int(-1))], false),
        ("LogSoftmax", vec![("axis", A::Int(-1))], false),
        ("LayerNormalization", vec![("axis", A::Int(-1))], true),
        ("ReduceSum", vec![("axes", A::Ints(vec![1]))], false),
        ("ReduceMean", vec![("axes", A::Ints(vec![1]))], false),
        ("ReduceMax", vec![("axes", A::Ints(vec![1]))], false),
    ];
    let mut inputs: Vec<(Tensor, usize)> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| (rows(n, 10 + i as u64), n))
        .collect();
    inputs.push((randn(&[2, 70000], 99), 70000));
    for dt in [DType::F32, DType::F16] {
        if !computes(BackendKind::Wgpu, dt) {
            continue;
        }
        for (x, n) in &inputs {
            for (name, attrs, params) in &cases {
                if *params && *n == 70000 {
                    continue;
                }
                let mut args = vec![inp(x.clone())];
                if *params {
                    args.push(inp(randn(&[*n], 3)));
                    args.push(inp(randn(&[*n], 4)));
                }
                let run = |b| {
                    let out = run_op(b, op(name, attrs), &args, 1, dt)
                        .unwrap_or_else(|e| panic!("{name} n={n} {dt} on {b:?}: {e}"));
                    out[0].to_f64_vec()
                };
                let want = run(BackendKind::Cpu);
                for sg in [false, true] {
                    graphrun::backends::wgpu::set_subgroups(sg);
                    let got = run(BackendKind::Wgpu);
                    let e = rel_err(&got, &want);
                    assert!(
                        e <= tol(dt),
                        "{name} n={n} {dt} subgroups={sg}: rel err {e:.3e} vs cpu"
                    );
                    let again = run(BackendKind::Wgpu);
                    assert!(
                        same_bits(&got, &again),
                        "{name} n={n} {dt} subgroups={sg}: reruns differ"
                    );
                }
            }
        }
    }
    graphrun::backends::wgpu::set_subgroups(true);
}
