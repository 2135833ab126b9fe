//! Shared test harness: one test body per op, run on every available backend and dtype,
//! compared against an independent float64 reference written in the test.
#![allow(dead_code)]

use graphrun::graph::op::{Attr, AttrValue};
use graphrun::graph::{Graph, InitSource, Initializer, InputInfo, Node, Op};
use graphrun::rng::Rng;
use graphrun::{BackendKind, DType, Session, SessionOptions, Tensor};

/// The developer harness's kernel variants for test executables: `GRAPHRUN_TUNE` holds
/// comma-separated `KEY=VALUE` settings of `graphrun::Tuning` (what `graphrun --tune`
/// takes; dev/README.md), applied once, before any GPU backend is made (every GPU test
/// asks `cuda_present` or `wgpu_present` first). The library itself reads no such variable.
pub fn dev_tuning() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(spec) = std::env::var("GRAPHRUN_TUNE") else {
            return;
        };
        let mut t = graphrun::tuning();
        for kv in spec.split(',').filter(|s| !s.trim().is_empty()) {
            t.apply(kv).unwrap_or_else(|e| panic!("GRAPHRUN_TUNE: {e}"));
        }
        graphrun::set_tuning(t);
    });
}

/// Backends to test on: the CPU always; GPU backends when present (they skip with a
/// printed reason otherwise, and never skip when `CI` asks for them).
pub fn backends() -> Vec<BackendKind> {
    let mut v = vec![BackendKind::Cpu];
    if cuda_present() {
        v.push(BackendKind::Cuda);
    }
    if wgpu_present() {
        v.push(BackendKind::Wgpu);
    }
    v
}

/// Whether the WebGPU backend runs here (a Vulkan adapter, lavapipe included); the first
/// call prints why not. With `CI` set (CI installs lavapipe) a missing adapter is a
/// failure, never a skip; a build without the `wgpu` feature skips, saying so.
pub fn wgpu_present() -> bool {
    dev_tuning();
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRESENT.get_or_init(|| match graphrun::backends::wgpu::available() {
        Ok(()) => true,
        Err(e) if cfg!(feature = "wgpu") && std::env::var_os("CI").is_some() => {
            panic!("CI is set but the WebGPU backend has no adapter: {e}")
        }
        Err(e) => {
            eprintln!("skipping WebGPU: {e}");
            false
        }
    })
}

/// The wgpu backend's error for integer arithmetic it does not do.
pub const WGPU_NO_I64: &str = "not supported by the wgpu backend (integer arithmetic";

/// Whether `backend` may refuse an op on these operands with `e`: one has a dtype it has
/// no type for (`graphrun::backends::NOT_ON_BACKEND`, e.g. WGSL's missing 64-bit
/// integers), or it is wgpu's documented refusal of integer arithmetic outside the
/// elementwise maps (tests/op_matrix.rs holds those to every dtype).
fn refusable(backend: BackendKind, args: &[Arg], e: &graphrun::Error) -> bool {
    let no_type = args.iter().any(|a| match a {
        Arg::In(t) | Arg::Const(t) => graphrun::backends::not_on(backend, t.dtype()),
        Arg::None => false,
    });
    no_type || backend == BackendKind::Wgpu && e.to_string().contains(WGPU_NO_I64)
}

/// Whether `backend` computes in float dtype `dt`. WGSL has no f64 or bf16 (and f16 only
/// with SHADER_F16): there the wgpu backend answers with an error, which tests/wgpu.rs
/// checks, instead of a result to compare.
pub fn computes(backend: BackendKind, dt: DType) -> bool {
    backend != BackendKind::Wgpu || graphrun::backends::wgpu::supports_float(dt)
}

/// Whether the CUDA backend runs here; the first call prints why not. With
/// `GRAPHRUN_REQUIRE_CUDA` set (the device script sets it) a missing GPU is a failure.
pub fn cuda_present() -> bool {
    dev_tuning();
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRESENT.get_or_init(|| match graphrun::backends::cuda::available() {
        Ok(()) => true,
        Err(e) if std::env::var_os("GRAPHRUN_REQUIRE_CUDA").is_some() => {
            panic!("GRAPHRUN_REQUIRE_CUDA is set but {e}")
        }
        Err(e) => {
            eprintln!("skipping CUDA: {e}");
            false
        }
    })
}

/// An argument of the op under test.
#[derive(Clone)]
pub enum Arg {
    /// Fed as a graph input at run time.
    In(Tensor),
    /// An initializer, known when the plan is made (shape-deciding inputs).
    Const(Tensor),
    /// An omitted optional input.
    None,
}

pub fn inp(t: Tensor) -> Arg {
    Arg::In(t)
}
pub fn cst(t: Tensor) -> Arg {
    Arg::Const(t)
}

/// Seeded random f64 tensor, uniform in [lo, hi).
pub fn rand(shape: &[usize], seed: u64, lo: f64, hi: f64) -> Tensor {
    let mut r = Rng::new(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| r.uniform_in(lo, hi)).collect();
    Tensor::from_vec(shape, v).unwrap()
}
/// Seeded standard-normal f64 tensor.
pub fn randn(shape: &[usize], seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let n: usize = shape.iter().product();
    Tensor::from_vec(shape, (0..n).map(|_| r.normal()).collect::<Vec<f64>>()).unwrap()
}
/// Seeded random integers in [lo, hi) as an i64 tensor.
pub fn rand_ints(shape: &[usize], seed: u64, lo: i64, hi: i64) -> Tensor {
    let mut r = Rng::new(seed);
    let n: usize = shape.iter().product();
    i64s(shape, &(0..n).map(|_| r.int_in(lo, hi)).collect::<Vec<_>>())
}
pub fn i64s(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::from_vec(shape, v.to_vec()).unwrap()
}
pub fn bools(shape: &[usize], v: &[bool]) -> Tensor {
    Tensor::from_vec(shape, v.iter().map(|&b| graphrun::Bool::from(b)).collect()).unwrap()
}
pub fn f64s(shape: &[usize], v: &[f64]) -> Tensor {
    Tensor::from_vec(shape, v.to_vec()).unwrap()
}

/// Builds an op from its ONNX name and attributes, as the YAML loader would.
pub fn op(name: &str, attrs: &[(&str, AttrValue)]) -> Op {
    let attrs: Vec<Attr> = attrs
        .iter()
        .map(|(k, v)| Attr {
            name: k.to_string(),
            value: v.clone(),
            loc: None,
        })
        .collect();
    Op::parse(name, &attrs, "test", None).unwrap_or_else(|e| panic!("{e}"))
}

/// A one-node graph: args become graph inputs `in{i}` or initializers `c{i}`.
pub fn one_node_graph(op: Op, args: &[Arg], n_out: usize) -> Graph {
    let mut inputs = vec![];
    let mut initializers = vec![];
    let mut names = vec![];
    for (i, a) in args.iter().enumerate() {
        match a {
            Arg::In(t) => {
                let name = format!("in{i}");
                inputs.push(InputInfo {
                    default: None,
                    name: name.clone(),
                    dtype: t.dtype(),
                    shape: t
                        .shape()
                        .iter()
                        .map(|&d| graphrun::graph::Dim::Fixed(d))
                        .collect(),
                    range: None,
                    loc: None,
                });
                names.push(name);
            }
            Arg::Const(t) => {
                let name = format!("c{i}");
                initializers.push(Initializer {
                    name: name.clone(),
                    tensor: t.clone(),
                    trainable: false,
                    source: InitSource::Data,
                    loc: None,
                });
                names.push(name);
            }
            Arg::None => names.push(String::new()),
        }
    }
    let outputs: Vec<String> = (0..n_out).map(|k| format!("out{k}")).collect();
    Graph {
        name: "test".into(),
        dims: Default::default(),
        inputs,
        outputs: outputs.clone(),
        initializers,
        nodes: vec![Node {
            name: "node".into(),
            op,
            inputs: names,
            outputs,
            loc: None,
        }],
        training: None,
        updates: vec![],
        file: None,
    }
}

/// Runs one op on a backend; floating args are cast to `dtype` first.
pub fn run_op(
    backend: BackendKind,
    op: Op,
    args: &[Arg],
    n_out: usize,
    dtype: DType,
) -> graphrun::Result<Vec<Tensor>> {
    let cast = |t: &Tensor| {
        if t.dtype().is_float() {
            t.cast(dtype)
        } else {
            t.clone()
        }
    };
    let args: Vec<Arg> = args
        .iter()
        .map(|a| match a {
            Arg::In(t) => Arg::In(cast(t)),
            Arg::Const(t) => Arg::Const(cast(t)),
            Arg::None => Arg::None,
        })
        .collect();
    run_raw(backend, op, &args, n_out)
}

/// The feeds of `one_node_graph(_, args, _)`: input i is named `in{i}`.
pub fn feeds_of(args: &[Arg]) -> std::collections::HashMap<String, Tensor> {
    args.iter()
        .enumerate()
        .filter_map(|(i, a)| match a {
            Arg::In(t) => Some((format!("in{i}"), t.clone())),
            _ => None,
        })
        .collect()
}

/// Runs one op on a backend with its arguments as given (no dtype cast).
pub fn run_raw(
    backend: BackendKind,
    op: Op,
    args: &[Arg],
    n_out: usize,
) -> graphrun::Result<Vec<Tensor>> {
    let g = one_node_graph(op, args, n_out);
    let feeds = feeds_of(args);
    let mut s = Session::new(
        g,
        SessionOptions {
            backend,
            ..SessionOptions::unfused()
        },
    )?;
    Ok(s.run(&feeds)?.into_iter().map(|(_, t)| t).collect())
}

/// Tolerance of SPEC §8 for a dtype (f64 tighter: it is the reference path itself).
pub fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// ‖out − ref‖ / ‖ref‖ (absolute when ref is 0); NaN never passes. Non-finite
/// reference entries must be matched exactly (same inf, NaN where NaN).
pub fn rel_err(out: &[f64], reference: &[f64]) -> f64 {
    assert_eq!(out.len(), reference.len(), "length mismatch");
    let (mut num, mut den) = (0.0, 0.0);
    for (&o, &r) in out.iter().zip(reference) {
        if !r.is_finite() {
            if !(o == r || (o.is_nan() && r.is_nan())) {
                return f64::INFINITY;
            }
            continue;
        }
        if o.is_nan() {
            return f64::NAN;
        }
        num += (o - r) * (o - r);
        den += r * r;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The expected result of an op: shape and f64 values per output.
pub type Expected = Vec<(Vec<usize>, Vec<f64>)>;

/// Runs `op` on every backend and every dtype in `dtypes` (floating args cast to it) and
/// compares each output with `reference`, which gets the args *after* rounding to the
/// dtype (as f64) so that only the kernel's error is measured.
pub fn check(
    op_: Op,
    args: &[Arg],
    dtypes: &[DType],
    reference: impl Fn(&[Option<Tensor>]) -> Expected,
) {
    check_tol(op_, args, dtypes, false, reference)
}

/// Like `check`, but every output, floating ones included, must equal the reference
/// exactly (results no rounding can excuse: comparisons, selections, integer maths).
pub fn check_exact(
    op_: Op,
    args: &[Arg],
    dtypes: &[DType],
    reference: impl Fn(&[Option<Tensor>]) -> Expected,
) {
    check_tol(op_, args, dtypes, true, reference)
}

fn check_tol(
    op_: Op,
    args: &[Arg],
    dtypes: &[DType],
    exact: bool,
    reference: impl Fn(&[Option<Tensor>]) -> Expected,
) {
    for backend in backends() {
        for &dt in dtypes.iter().filter(|&&dt| computes(backend, dt)) {
            let rounded: Vec<Option<Tensor>> = args
                .iter()
                .map(|a| match a {
                    Arg::In(t) | Arg::Const(t) => Some(if t.dtype().is_float() {
                        t.cast(dt).cast(DType::F64)
                    } else {
                        t.clone()
                    }),
                    Arg::None => None,
                })
                .collect();
            let want = reference(&rounded);
            let got = match run_op(backend, op_.clone(), args, want.len(), dt) {
                Ok(got) => got,
                // WGSL has no 64-bit integers: wgpu answers most integer arithmetic with this
                // error by design (src/backends/wgpu/mod.rs); anything else fails.
                Err(e) if refusable(backend, args, &e) => {
                    eprintln!("{} on wgpu: {e}", op_.name());
                    continue;
                }
                Err(e) => panic!("{} on {backend:?} {dt}: {e}", op_.name()),
            };
            for (k, ((shape, vals), t)) in want.iter().zip(&got).enumerate() {
                assert_eq!(
                    t.shape(),
                    &shape[..],
                    "{} on {backend:?} {dt}: output {k} shape",
                    op_.name()
                );
                let out = t.to_f64_vec();
                let e = rel_err(&out, vals);
                // Integer and bool outputs must be exact.
                let tl = if t.dtype().is_float() && !exact {
                    tol(dt)
                } else {
                    0.0
                };
                assert!(
                    e <= tl,
                    "{} on {backend:?} {dt}: output {k} rel err {e:.3e} > {:.0e}\n got {:?}\nwant {:?}",
                    op_.name(),
                    tl,
                    &out[..out.len().min(8)],
                    &vals[..vals.len().min(8)]
                );
            }
        }
    }
}

/// Float dtypes every float op is tested in.
pub const FLOATS: [DType; 4] = [DType::F64, DType::F32, DType::F16, DType::BF16];

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Index of output position `idx` (multi-index over `out_shape`) into a broadcast
/// input of shape `in_shape` (numpy rules), as a flat offset.
pub fn bcast_offset(idx: &[usize], in_shape: &[usize]) -> usize {
    let off = idx.len() - in_shape.len();
    let st = strides(in_shape);
    in_shape
        .iter()
        .enumerate()
        .map(|(i, &d)| if d == 1 { 0 } else { idx[off + i] * st[i] })
        .sum()
}

/// Every multi-index of a shape in row-major order.
pub fn indices(shape: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = shape.iter().product();
    let st = strides(shape);
    (0..n)
        .map(|f| {
            shape
                .iter()
                .enumerate()
                .map(|(i, &d)| (f / st[i]) % d.max(1))
                .collect()
        })
        .collect()
}

/// The flat indices of `shape` grouped by their position off `axes`: each group is what a
/// reduction over `axes` combines, the groups in row-major order of the other dims.
pub fn groups(shape: &[usize], axes: &[usize]) -> Vec<Vec<usize>> {
    let kept: Vec<usize> = (0..shape.len())
        .map(|d| if axes.contains(&d) { 1 } else { shape[d] })
        .collect();
    let ks = strides(&kept);
    let mut out: Vec<Vec<usize>> = vec![vec![]; kept.iter().product()];
    for (f, p) in indices(shape).iter().enumerate() {
        let at: usize = p
            .iter()
            .zip(&kept)
            .zip(&ks)
            .map(|((&i, &k), &s)| if k == 1 { 0 } else { i * s })
            .sum();
        out[at].push(f);
    }
    out
}

// ---- gradient checks --------------------------------------------------------------------

/// A node for `eval_node`: inputs `in{i}` ("" where absent), outputs as named ("" marks an
/// output the graph does not read).
pub fn node_of(op: Op, ins: &[Option<Tensor>], outs: &[&str]) -> Node {
    Node {
        name: "node".into(),
        op,
        inputs: ins
            .iter()
            .enumerate()
            .map(|(i, t)| t.as_ref().map(|_| format!("in{i}")).unwrap_or_default())
            .collect(),
        outputs: outs.iter().map(|s| s.to_string()).collect(),
        loc: None,
    }
}

/// Infers and evaluates one node on the CPU.
pub fn eval(node: &Node, ins: &[Option<Tensor>]) -> graphrun::Result<Vec<Tensor>> {
    let refs: Vec<Option<&Tensor>> = ins.iter().map(|t| t.as_ref()).collect();
    graphrun::backends::cpu::eval_node(node, &refs)
}

/// Central finite differences in f64 (step 1e-6) of `Σ dy ∘ node(ins)[out]` with respect to
/// every element of input `wrt`.
pub fn fd_grad(
    node: &Node,
    ins: &[Option<Tensor>],
    wrt: usize,
    out: usize,
    dy: &Tensor,
) -> Vec<f64> {
    const H: f64 = 1e-6;
    let dy = dy.to_f64_vec();
    let x = ins[wrt].as_ref().expect("input to differentiate").clone();
    let xv = x.to_f64_vec();
    let loss = |i: usize, h: f64| {
        let mut v = xv.clone();
        v[i] += h;
        let mut ins = ins.to_vec();
        ins[wrt] = Some(Tensor::from_vec(x.shape(), v).unwrap());
        let y = eval(node, &ins).unwrap_or_else(|e| panic!("{e}"))[out].to_f64_vec();
        y.iter().zip(&dy).map(|(y, d)| y * d).sum::<f64>()
    };
    (0..xv.len())
        .map(|i| (loss(i, H) - loss(i, -H)) / (2.0 * H))
        .collect()
}

/// Sums `v` (of shape `from`) down to the broadcastable shape `to`: the gradient of an input
/// that was broadcast.
pub fn sum_to(v: &[f64], from: &[usize], to: &[usize]) -> Vec<f64> {
    let mut out = vec![0.0; to.iter().product()];
    for (idx, x) in indices(from).iter().zip(v) {
        out[bcast_offset(idx, to)] += x;
    }
    out
}

/// Evaluates `node` in f64, checks that f32, f16 and bf16 give the same outputs within
/// SPEC §8 tolerance (each run on the same inputs rounded to its dtype, and compared with
/// f64 on those rounded inputs), and returns the f64 outputs. Inputs listed in `stats`
/// take the statistics dtype (f32, or f64 for f64) rather than the data dtype.
pub fn eval_all_dtypes(node: &Node, ins: &[Option<Tensor>], stats: &[usize]) -> Vec<Tensor> {
    let cast = |dt: DType| -> Vec<Option<Tensor>> {
        ins.iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_ref().map(|t| {
                    if !t.dtype().is_float() {
                        t.clone()
                    } else if stats.contains(&i) && dt != DType::F64 {
                        t.cast(DType::F32)
                    } else {
                        t.cast(dt)
                    }
                })
            })
            .collect()
    };
    let run = |ins: &[Option<Tensor>]| {
        eval(node, ins).unwrap_or_else(|e| panic!("{}: {e}", node.op.name()))
    };
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let low = cast(dt);
        let back: Vec<Option<Tensor>> = low
            .iter()
            .map(|t| {
                t.as_ref().map(|t| {
                    if t.dtype().is_float() {
                        t.cast(DType::F64)
                    } else {
                        t.clone()
                    }
                })
            })
            .collect();
        let (got, want) = (run(&low), run(&back));
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            if node.outputs[k].is_empty() {
                continue;
            }
            assert_eq!(g.dtype(), dt, "{} output {k}", node.op.name());
            let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
            assert!(
                e <= tol(dt),
                "{} in {dt}: output {k} rel err {e:.3e} > {:.0e}",
                node.op.name(),
                tol(dt)
            );
        }
    }
    run(&cast(DType::F64))
}

/// Asserts an analytic gradient matches finite differences: relative error ≤ `tol`.
pub fn assert_grad(what: &str, got: &[f64], fd: &[f64], tol: f64) {
    let e = rel_err(got, fd);
    assert!(
        e <= tol,
        "{what}: rel err {e:.3e} > {tol:.0e} against finite differences\n got {:?}\nwant {:?}",
        &got[..got.len().min(8)],
        &fd[..fd.len().min(8)]
    );
}

/// Device out-of-memory (issue 8): a model whose one output needs 1 TiB runs on `backend`
/// and must end in an error that names the node writing it, not an abort.
pub fn out_of_memory_names_the_node(backend: BackendKind) {
    // The host-side cap (physical memory by default) would refuse it first.
    graphrun::tensor::set_max_bytes(usize::MAX / 2);
    let yaml = "graphrun: 1\nname: oom\ninputs:\n  - {name: x, dtype: f32, shape: [1]}\n\
                outputs: [y]\ninitializers:\n  - {name: big, dtype: i64, shape: [1], values: [274877906944]}\n\
                nodes:\n  - {op: Expand, inputs: [x, big], outputs: [y], name: huge_expand}\n";
    let model = graphrun::Model::from_str(yaml, ".").unwrap();
    let feeds = model.random_inputs(1, &Default::default()).unwrap();
    let opts = graphrun::SessionOptions {
        backend,
        ..graphrun::SessionOptions::unfused()
    };
    let e = graphrun::Session::new(model.graph, opts)
        .and_then(|mut s| s.run(&feeds))
        .expect_err("a 1 TiB output cannot be allocated")
        .to_string();
    assert!(e.contains("huge_expand") && e.contains("'y'"), "{e}");
    assert!(
        e.contains("out of memory") || e.contains("limit"),
        "the error says why: {e}"
    );
}

/// Attention's `[B, H, S, W]` as its 3-D form `[B, S, H·W]` (f64).
pub fn pack_heads(t: &Tensor) -> Tensor {
    let &[b, h, s, w] = t.shape() else {
        panic!("pack takes 4-D")
    };
    let x = t.to_f64_vec();
    let mut y = vec![0.0; x.len()];
    for (i, v) in x.iter().enumerate() {
        let (bi, hi, si, wi) = (i / (h * s * w), i / (s * w) % h, i / w % s, i % w);
        y[((bi * s + si) * h + hi) * w + wi] = *v;
    }
    f64s(&[b, s, h * w], &y)
}

/// The inverse of `pack_heads` for `h` heads.
pub fn unpack_heads(t: &Tensor, h: usize) -> Tensor {
    let &[b, s, hw] = t.shape() else {
        panic!("unpack takes 3-D")
    };
    let w = hw / h;
    let x = t.to_f64_vec();
    let mut y = vec![0.0; x.len()];
    for (i, v) in x.iter().enumerate() {
        let (bi, si, hi, wi) = (i / (s * hw), i / hw % s, i / w % h, i % w);
        y[((bi * h + hi) * s + si) * w + wi] = *v;
    }
    f64s(&[b, h, s, w], &y)
}

/// Tensors of equal leading dims joined on their last axis (f64): the packed QKV of
/// Attention's K-and-V-omitted form.
pub fn concat_last(ts: &[&Tensor]) -> Tensor {
    let lead = &ts[0].shape()[..ts[0].shape().len() - 1];
    let ws: Vec<usize> = ts.iter().map(|t| *t.shape().last().unwrap()).collect();
    let rows: usize = lead.iter().product();
    let vs: Vec<Vec<f64>> = ts.iter().map(|t| t.to_f64_vec()).collect();
    let mut y = vec![];
    for r in 0..rows {
        for (v, &w) in vs.iter().zip(&ws) {
            y.extend_from_slice(&v[r * w..(r + 1) * w]);
        }
    }
    let mut shape = lead.to_vec();
    shape.push(ws.iter().sum());
    f64s(&shape, &y)
}

/// The inverse of `concat_last` for parts of widths `ws` (f64).
pub fn split_last(t: &Tensor, ws: &[usize]) -> Vec<Tensor> {
    let (lead, w) = t.shape().split_at(t.shape().len() - 1);
    let v = t.to_f64_vec();
    let mut at = 0;
    ws.iter()
        .map(|&n| {
            let part: Vec<f64> = v
                .chunks(w[0])
                .flat_map(|r| r[at..at + n].to_vec())
                .collect();
            at += n;
            let mut shape = lead.to_vec();
            shape.push(n);
            f64s(&shape, &part)
        })
        .collect()
}

/// The attributes of a 3-D Attention: `hq` query heads, `hkv` key/value heads.
pub fn heads_attrs(hq: usize, hkv: usize, causal: bool) -> Vec<(&'static str, AttrValue)> {
    vec![
        ("is_causal", AttrValue::Int(causal as i64)),
        ("q_num_heads", AttrValue::Int(hq as i64)),
        ("kv_num_heads", AttrValue::Int(hkv as i64)),
    ]
}

/// Random Q [B, Hq, Sq, D], K [B, Hkv, Skv, D], V [B, Hkv, Skv, Dv] (seeds `seed`..`seed`+2)
/// from `[b, hq, hkv, sq, skv, d, dv]`; `packed`: in the 3-D layout [B, S, H·D] instead.
pub fn attention_qkv(dims: [usize; 7], seed: u64, packed: bool) -> [Tensor; 3] {
    let [b, hq, hkv, sq, skv, d, dv] = dims;
    let t = |shape: [usize; 4], k| {
        let t = randn(&shape, seed + k);
        if packed {
            pack_heads(&t)
        } else {
            t
        }
    };
    [
        t([b, hq, sq, d], 0),
        t([b, hkv, skv, d], 1),
        t([b, hkv, skv, dv], 2),
    ]
}

/// Attention with packed QKV (K and V omitted, rule `attention_qkv`), forward and
/// backward on `backend` against the CPU, in `dts`: multi-head at D = 64 (CUDA's
/// tensor-core kernels) causal and not, grouped-query at D = 16. The backward runs from
/// the CPU's Y and LSE and writes one packed dQKV.
pub fn packed_qkv_same_as_cpu(backend: BackendKind, dts: &[DType]) {
    for (n, &(b, s, hq, hkv, d, causal)) in [
        (2, 130, 4, 4, 64, true),
        (1, 70, 4, 4, 64, false),
        (2, 40, 4, 2, 16, true),
    ]
    .iter()
    .enumerate()
    {
        let attrs = heads_attrs(hq, hkv, causal);
        let seed = 700 + 10 * n as u64;
        let qkv = randn(&[b, s, (hq + 2 * hkv) * d], seed);
        let dy = randn(&[b, s, hq * d], seed + 1);
        for &dt in dts.iter().filter(|&&dt| computes(backend, dt)) {
            let fargs = [inp(qkv.cast(dt)), Arg::None, Arg::None];
            let run = |be, name, args: &[Arg], n_out| {
                run_raw(be, op(name, &attrs), args, n_out)
                    .unwrap_or_else(|e| panic!("case {n} {name} on {be:?} {dt}: {e}"))
            };
            let want = run(BackendKind::Cpu, "Attention", &fargs, 2);
            let got = run(backend, "Attention", &fargs, 2);
            let bargs = [
                inp(dy.cast(dt)),
                inp(qkv.cast(dt)),
                Arg::None,
                Arg::None,
                inp(want[0].clone()),
                inp(want[1].clone()),
            ];
            let gw = run(BackendKind::Cpu, "AttentionGrad", &bargs, 1);
            let gg = run(backend, "AttentionGrad", &bargs, 1);
            for (what, g, w) in [
                ("Y", &got[0], &want[0]),
                ("LSE", &got[1], &want[1]),
                ("dQKV", &gg[0], &gw[0]),
            ] {
                assert_eq!(g.shape(), w.shape(), "case {n} {dt} {what}");
                let e = rel_err(&g.to_f64_vec(), &w.to_f64_vec());
                assert!(e <= tol(dt), "case {n} {dt} {what}: rel err {e:.3e}");
            }
        }
    }
}

/// FusedMatMulGrad with `a_activation` (fc2's gradient after `dact_into_da`): for each
/// activation in `acts`, with a shared and a batched B, calls `each(act, attrs, args)`;
/// run with 4 outputs, the last is dBiasA (dA's row sum, fc1's bias gradient).
pub fn a_activation_cases(acts: &[&str], mut each: impl FnMut(&str, &[(&str, AttrValue)], &[Arg])) {
    let dy = randn(&[2, 70, 90], 31);
    let a = randn(&[2, 70, 130], 32);
    let pre_a = randn(&[2, 70, 130], 33);
    for b in [randn(&[130, 90], 34), randn(&[2, 130, 90], 35)] {
        for &act in acts {
            let at = [
                ("activation", AttrValue::Str("none".into())),
                ("a_activation", AttrValue::Str(act.into())),
            ];
            let args = [
                inp(dy.clone()),
                inp(a.clone()),
                inp(b.clone()),
                Arg::None,
                inp(pre_a.clone()),
            ];
            each(act, &at, &args);
        }
    }
}

/// One op case: (op, attributes, args, number of outputs).
pub type OpCase = (
    &'static str,
    Vec<(&'static str, AttrValue)>,
    Vec<Arg>,
    usize,
);

/// GatedMatMul's cases for a backend against the CPU, as (op, attributes, args, outputs):
/// Y alone, Y with G and U, and GatedMatMulGrad, across several thread blocks, for the
/// gates the exporters' MLPs use.
pub fn gated_matmul_cases() -> Vec<OpCase> {
    let a = randn(&[3, 37, 24], 70);
    let (wg, wu) = (randn(&[24, 40], 71), randn(&[24, 40], 72));
    let (bg, bu) = (randn(&[40], 73), randn(&[40], 74));
    let (g, u, dy) = (
        randn(&[111, 40], 75),
        randn(&[111, 40], 76),
        randn(&[111, 40], 77),
    );
    let mut cases = vec![];
    for act in ["silu", "gelu_tanh", "gelu", "sigmoid"] {
        let attrs = vec![("activation", AttrValue::Str(act.into()))];
        let args: Vec<Arg> = [&a, &wg, &wu, &bg, &bu].map(|t| inp(t.clone())).to_vec();
        cases.push(("GatedMatMul", attrs.clone(), args[..3].to_vec(), 1));
        cases.push(("GatedMatMul", attrs.clone(), args, 3));
        let grad_args = [&dy, &g, &u].map(|t| inp(t.clone())).to_vec();
        cases.push(("GatedMatMulGrad", attrs, grad_args, 2));
    }
    cases
}
