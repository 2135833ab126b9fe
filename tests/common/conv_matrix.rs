//! Conv, ConvGrad and FusedConv on given backends against the CPU in float64, shared by
//! tests/op_matrix.rs (every backend) and tests/cuda_conv_im2col.rs (CUDA without cuDNN).

use super::common::*;
use graphrun::backends::not_on;
use graphrun::{BackendKind, DType};

/// FusedConv's activations checked here, each with an f64 formula of its own.
type Reference = fn(f64) -> f64;
const ACTIVATIONS: [(&str, Reference); 5] = [
    ("none", |v| v),
    ("relu", |v| v.max(0.0)),
    ("silu", |v| v / (1.0 + (-v).exp())),
    ("tanh", |v| v.tanh()),
    ("relu6", |v| v.clamp(0.0, 6.0)),
];

/// Conv, ConvGrad and FusedConv × every backend × every floating dtype, against the CPU in float64
/// (tests/ops_window.rs checks that against direct-loop references): grouped, depthwise,
/// 1×1 and 1-D settings, each within the dtype's tolerance (f16/bf16 inputs are the
/// rounded f64 data, so only the computation's rounding differs).
pub fn convolutions_match_the_cpu(backends: &[BackendKind]) {
    use graphrun::graph::op::AttrValue as V;
    let ints = |v: &[i64]| V::Ints(v.to_vec());
    // (X, W, attributes)
    type Setting = (Vec<usize>, Vec<usize>, Vec<(&'static str, V)>);
    let settings: Vec<Setting> = vec![
        (
            vec![2, 4, 9, 8],
            vec![6, 2, 3, 3],
            vec![
                ("group", V::Int(2)),
                ("strides", ints(&[2, 1])),
                ("pads", ints(&[1, 1, 1, 1])),
            ],
        ),
        (
            vec![2, 4, 7, 7],
            vec![4, 1, 3, 3],
            vec![("group", V::Int(4)), ("pads", ints(&[1, 1, 1, 1]))],
        ),
        (vec![3, 8, 5, 5], vec![5, 8, 1, 1], vec![]),
        // One output tile over a sum of 1 152 terms: WebGPU splits the sum in 9 parts.
        (
            vec![1, 128, 5, 5],
            vec![16, 128, 3, 3],
            vec![("pads", ints(&[1, 1, 1, 1]))],
        ),
        (
            vec![2, 3, 11],
            vec![4, 3, 3],
            vec![("dilations", ints(&[2])), ("pads", ints(&[2, 1]))],
        ),
    ];
    for (k, (xs, ws, attrs)) in settings.iter().enumerate() {
        let seed = 100 + 3 * k as u64;
        // Weights scaled by 1/√fan-in, as networks initialise them: the outputs stay near
        // 1, where the activations' slopes do not amplify 16-bit rounding.
        let fan_in: usize = ws[1..].iter().product();
        let w = randn(ws, seed + 1).to_f64_vec();
        let w = f64s(
            ws,
            &w.iter()
                .map(|v| v / (fan_in as f64).sqrt())
                .collect::<Vec<_>>(),
        );
        let x = randn(xs, seed);
        let b = randn(&[ws[0]], seed + 2);
        let conv = op("Conv", attrs);
        let want = run_raw(
            BackendKind::Cpu,
            conv.clone(),
            &[inp(x.clone()), inp(w.clone()), inp(b.clone())],
            1,
        )
        .unwrap_or_else(|e| panic!("Conv setting {k} on the CPU: {e}"));
        let dy = randn(want[0].shape(), seed + 3);
        let z = randn(want[0].shape(), seed + 4);
        let grad = op("ConvGrad", attrs);
        let gargs = |dt: DType| [inp(dy.cast(dt)), inp(x.cast(dt)), inp(w.cast(dt))];
        let gwant = run_raw(BackendKind::Cpu, grad.clone(), &gargs(DType::F64), 2)
            .unwrap_or_else(|e| panic!("ConvGrad setting {k} on the CPU: {e}"));
        for &backend in backends {
            for dt in [DType::F64, DType::F32, DType::F16, DType::BF16] {
                if !computes(backend, dt) {
                    continue;
                }
                let what = format!("setting {k} {dt} on {backend:?}");
                let args = [inp(x.cast(dt)), inp(w.cast(dt)), inp(b.cast(dt))];
                let got = match run_raw(backend, conv.clone(), &args, 1) {
                    Ok(g) => g,
                    Err(e) if not_on(backend, dt) => {
                        assert!(e.to_string().contains("node"), "{e}");
                        continue;
                    }
                    Err(e) => panic!("Conv {what}: {e}"),
                };
                // f32 and f64 sum in other orders than the CPU; f16/bf16 round the output.
                let bound = tol(dt).max(1e-9) * if dt.size() >= 4 { 10.0 } else { 1.0 };
                let err = rel_err(&got[0].to_f64_vec(), &want[0].to_f64_vec());
                assert!(err <= bound, "Conv {what}: error {err}");
                let got = run_raw(backend, grad.clone(), &gargs(dt), 2)
                    .unwrap_or_else(|e| panic!("ConvGrad {what}: {e}"));
                for (i, name) in ["dX", "dW"].iter().enumerate() {
                    let err = rel_err(&got[i].to_f64_vec(), &gwant[i].to_f64_vec());
                    assert!(err <= bound, "ConvGrad {name} {what}: error {err}");
                }
                // FusedConv, Y = act(conv + B + Z) and Pre = conv + B + Z, against the
                // CPU's f64 convolution and the activations written here.
                let pre: Vec<f64> = want[0]
                    .to_f64_vec()
                    .iter()
                    .zip(z.to_f64_vec())
                    .map(|(c, z)| c + z)
                    .collect();
                for (act, f) in ACTIVATIONS {
                    let mut fa = attrs.clone();
                    fa.push(("activation", V::Str(act.into())));
                    let mut args = args.to_vec();
                    args.push(inp(z.cast(dt)));
                    let got = run_raw(backend, op("FusedConv", &fa), &args, 2)
                        .unwrap_or_else(|e| panic!("FusedConv {act} {what}: {e}"));
                    let y: Vec<f64> = pre.iter().map(|&v| f(v)).collect();
                    let err = rel_err(&got[0].to_f64_vec(), &y);
                    assert!(err <= bound, "FusedConv {act} Y {what}: error {err}");
                    let err = rel_err(&got[1].to_f64_vec(), &pre);
                    assert!(err <= bound, "FusedConv {act} Pre {what}: error {err}");
                }
            }
        }
    }
}
