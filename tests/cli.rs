//! The command line (SPEC §5): what it prints, what it writes, and its exit codes.

#[path = "common/dirs.rs"]
mod dirs;
use dirs::*;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn graphrun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graphrun"))
        .args(args)
        .output()
        .unwrap()
}
fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn runs_the_mlp_with_random_inputs() {
    let o = graphrun(&["models/mlp.yaml"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("logits: f32 [64, 10]")
            && out.contains("loss: f32 []")
            && out.contains("mean"),
        "{out}"
    );
    assert!(
        err.contains("random data"),
        "graphrun says it filled the inputs: {err}"
    );
    // Same seed, same output; another seed, another output.
    assert_eq!(text(&graphrun(&["models/mlp.yaml"])).0, out);
    assert_ne!(text(&graphrun(&["models/mlp.yaml", "--seed", "5"])).0, out);
}

#[test]
fn out_dir_writes_every_output_and_inputs_round_trip() {
    let d = tmpdir("out");
    let o = graphrun(&[
        "models/mlp.yaml",
        "--dim",
        "batch=4",
        "--out-dir",
        d.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert_eq!(files_in(&d), vec!["logits.npy", "loss.npy"]);
    let logits = graphrun::Tensor::read_npy(&d.join("logits.npy")).unwrap();
    assert_eq!(logits.shape(), &[4, 10]);
    // Feed an input from a file; the rest random with --random-inputs.
    let x = graphrun::Tensor::from_vec(
        &[4, 784],
        (0..4 * 784)
            .map(|i| (i % 7) as f32 * 0.1)
            .collect::<Vec<f32>>(),
    )
    .unwrap();
    x.write_npy(&d.join("x_in.npy")).unwrap();
    let xin = format!("x={}", d.join("x_in.npy").display());
    let o = graphrun(&["models/mlp.yaml", "--input", &xin]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "partial --input without --random-inputs is an error"
    );
    assert!(text(&o).1.contains("'labels'"), "{}", text(&o).1);
    let o = graphrun(&["models/mlp.yaml", "--input", &xin, "--random-inputs"]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(text(&o).0.contains("logits: f32 [4, 10]"));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_model_exits_2_with_place() {
    let d = tmpdir("bad");
    let p = d.join("bad.yaml");
    std::fs::write(&p, "graphrun: 1\noutputs: [y]\nnodes:\n  - {op: Relu, inputs: [x], outputs: [y], colour: red}\n").unwrap();
    let o = graphrun(&[p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o).1;
    assert!(
        err.contains("bad.yaml:4:") && err.contains("unknown field 'colour'"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "one clear line: {err}");
    let o = graphrun(&["no/such/model.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    let o = graphrun(&["models/mlp.yaml", "--dim", "batch"]);
    assert_eq!(o.status.code(), Some(2));
    let o = graphrun(&["models/mlp.yaml", "--bogus-flag"]);
    assert_eq!(o.status.code(), Some(2));
    let o = graphrun(&["models/mlp.yaml", "--input", "x=/no/such.npy"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("/no/such.npy"));
    let _ = std::fs::remove_dir_all(&d);
}

/// `--tune KEY=VALUE` (the developer harness's kernel variants) works on every command,
/// is not in the help, and refuses an unknown key or a bad value with exit code 2.
#[test]
fn tune_is_a_hidden_developer_flag() {
    let plain = graphrun(&["models/mlp.yaml"]);
    let o = graphrun(&[
        "models/mlp.yaml",
        "--tune",
        "cublaslt_tune=1",
        "--tune",
        "k_major_weights=0",
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert_eq!(
        text(&o).0,
        text(&plain).0,
        "the CPU ignores GPU kernel choices"
    );
    let o = graphrun(&[
        "bench",
        "models/mlp.yaml",
        "--iters",
        "1",
        "--tune",
        "dp_bucket_bytes=65536",
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    for help in [&["--help"][..], &["run", "--help"], &["bench", "--help"]] {
        let out = text(&graphrun(help)).0;
        assert!(!out.contains("--tune"), "--tune is hidden: {out}");
    }
    let o = graphrun(&["models/mlp.yaml", "--tune", "no_such_key=1"]);
    assert_eq!(o.status.code(), Some(2));
    let err = text(&o).1;
    assert!(
        err.contains("unknown tuning key 'no_such_key'") && err.contains("cuda_attention"),
        "{err}"
    );
    let o = graphrun(&["models/mlp.yaml", "--tune", "cuda_graphs=maybe"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("cuda_graphs"), "{}", text(&o).1);
    let o = graphrun(&["models/mlp.yaml", "--tune", "cuda_graphs"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn runtime_failure_exits_1_and_leaves_no_partial_output() {
    let d = tmpdir("fail");
    let m = d.join("gather.yaml");
    std::fs::write(
        &m,
        "graphrun: 1\ninputs: [{name: ids, dtype: i64, shape: [3]}]\noutputs: [t, e]\ninitializers:\n  - {name: table, dtype: f32, shape: [4, 2], init: ones}\nnodes:\n  - {op: Identity, inputs: [table], outputs: [t]}\n  - {op: Gather, inputs: [table, ids], outputs: [e], name: embed}\n",
    )
    .unwrap();
    let ids = graphrun::Tensor::from_vec(&[3], vec![0i64, 9, 1]).unwrap();
    ids.write_npy(&d.join("ids.npy")).unwrap();
    let out = d.join("out");
    let o = graphrun(&[
        m.to_str().unwrap(),
        "--input",
        &format!("ids={}", d.join("ids.npy").display()),
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{:?}", text(&o));
    let err = text(&o).1;
    assert!(err.contains("embed") && err.contains('9'), "{err}");
    assert!(
        files_in(&out).is_empty(),
        "no partial output: {:?}",
        files_in(&out)
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn missing_gpu_backend_is_one_clear_line() {
    // Only where the backend is absent (lavapipe gives wgpu an adapter in CI).
    let absent = [
        ("cuda", graphrun::backends::cuda::available().is_err()),
        ("wgpu", graphrun::backends::wgpu::available().is_err()),
    ];
    for b in absent.iter().filter(|(_, a)| *a).map(|(b, _)| *b) {
        let o = graphrun(&["models/mlp.yaml", "--backend", b]);
        assert_eq!(o.status.code(), Some(1));
        let err = text(&o).1;
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(b) && !err.contains("panicked"), "{err}");
    }
}

#[test]
fn inspect_prints_counts_memory_and_writes_files() {
    let d = tmpdir("inspect");
    let dot = d.join("g.dot");
    let yaml = d.join("g.yaml");
    let o = graphrun(&[
        "inspect",
        "models/gpt_block.yaml",
        "--dim",
        "batch=2",
        "--dim",
        "seq=64",
        "--dot",
        dot.to_str().unwrap(),
        "--emit-yaml",
        yaml.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for want in [
        "MatMul 6",
        "LayerNormalization 2",
        "Softmax 1",
        "parameters:",
        "peak activation memory",
        "without buffer reuse",
        "FLOP",
        "attention_fusion         2 rewrites (attention_heads ×1, attention_qkv ×1)",
        "matmul_epilogue_fusion   5 rewrites (matmul_epilogue ×4, mean_square ×1)",
        "rules applied:
  attention_fusion: attention_heads at 'attn_softmax'
  attention_fusion: attention_qkv at 'pv'
",
        "  matmul_epilogue_fusion: matmul_epilogue at 'fc2'
",
        "after passes: 9 nodes: Attention 1, FusedMatMul 4, LayerNormalization 2, ReduceMeanSquare 1, Sub 1
",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    assert!(std::fs::read_to_string(&dot)
        .unwrap()
        .starts_with("digraph"));
    let o = graphrun(&[
        yaml.to_str().unwrap(),
        "--dim",
        "batch=1",
        "--dim",
        "seq=8",
        "--quiet",
    ]);
    assert!(o.status.success(), "emitted model runs: {}", text(&o).1);
    // The model's defaults plan it, and it says so.
    let o = graphrun(&["inspect", "models/gpt_block.yaml", "--nodes"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for want in [
        "output types (unbound symbols as symbols):\n  y: f32[batch, seq, 1024]\n  loss: f32[]\n",
        "plan (batch=8, seq=1024)",
        "'batch', 'seq' from the model's dims: defaults",
        // --nodes: node by node, symbolic where no --dim binds the symbol.
        "nodes (9, in execution order):\n  ln1 LayerNormalization\n    in   x: f32[batch, seq, 1024], ln1_scale: f32[1024], ln1_bias: f32[1024]\n",
        "  fc1 FusedMatMul (bias, gelu_tanh)\n    in   ln2: f32[batch, seq, 1024], w_fc1: f32[1024, 4096], b_fc1: f32[4096]\n    out  g: f32[batch, seq, 4096]\n",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    let o = graphrun(&[
        "inspect",
        "models/gpt_block.yaml",
        "--nodes",
        "--dim",
        "seq=8",
    ]);
    let out = text(&o).0;
    assert!(out.contains("    out  g: f32[batch, 8, 4096]"), "{out}");
    assert!(out.contains("'batch' from the model's dims"), "{out}");
    // A model that refuses sizes over a thousand (GPT-2's position table has 32 rows) is
    // shown at small sizes.
    let o = graphrun(&["inspect", "tests/fixtures/zoo/gpt2_dynamo_op18/model.onnx"]);
    let out = text(&o).0;
    assert!(
        out.contains(
            "output types (unbound symbols as symbols):\n  logits: f32[batch, sequence, 100]\n"
        ),
        "{out}"
    );
    // Unbound symbols without defaults: symbolic shapes, memory as a formula, and the
    // written model keeps the symbol.
    let o = graphrun(&[
        "inspect",
        "tests/data/unbound.yaml",
        "--emit-yaml",
        yaml.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    for want in [
        "  y: f32[n, 4]",
        "plan: not made, symbolic dim 'n' has no size (give --dim n=N to plan)",
        "activation memory at most 32*n bytes",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    let written = std::fs::read_to_string(&yaml).unwrap();
    assert!(written.contains("shape: [n, 4]"), "{written}");
    // The backward graph is built for sizes: there an unbound symbol is named.
    let o = graphrun(&["inspect", "tests/data/unbound.yaml", "--backward"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("'n'"), "{}", text(&o).1);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn inspect_no_fuse_disable_pass_explain_fusion_and_dot_marks() {
    let d = tmpdir("inspect_flags");
    let dot = d.join("g.dot");
    let base = [
        "inspect",
        "models/gpt_block.yaml",
        "--dim",
        "batch=1",
        "--dim",
        "seq=8",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend(extra);
        let o = graphrun(&args);
        assert!(o.status.success(), "{}", text(&o).1);
        text(&o).0
    };
    let out = run(&["--no-fuse"]);
    assert!(
        out.contains("passes: off (--no-fuse)") && out.contains("after passes: 41 nodes"),
        "{out}"
    );
    // Attention fusion off: the Softmax and its two MatMuls are explained.
    let out = run(&[
        "--disable-pass",
        "attention_fusion",
        "--explain-fusion",
        "--dot",
        dot.to_str().unwrap(),
    ]);
    assert!(out.contains("attention_fusion         disabled"), "{out}");
    assert!(
        out.contains("  Softmax 'attn_softmax': attention_fusion is disabled")
            && out.contains("  MatMul 'qk': matmul_epilogue: "),
        "{out}"
    );
    // Fused nodes are drawn filled, the others not.
    let dot = std::fs::read_to_string(&dot).unwrap();
    let filled: Vec<&str> = dot.lines().filter(|l| l.contains("style=filled")).collect();
    assert_eq!(
        filled.len(),
        5,
        "the four FusedMatMuls and the mean square:\n{dot}"
    );
    assert!(
        filled
            .iter()
            .all(|l| l.contains("FusedMatMul") || l.contains("ReduceMeanSquare")),
        "{dot}"
    );
    assert!(
        dot.contains("Softmax")
            && !dot
                .lines()
                .any(|l| l.contains("Softmax") && l.contains("filled"))
    );
    let out = run(&["--explain-fusion"]);
    assert!(
        out.contains("explain-fusion: every MatMul and Softmax was fused"),
        "{out}"
    );
    // An unknown pass name is a usage error naming the passes.
    let o = graphrun(&["inspect", "models/mlp.yaml", "--disable-pass", "fusion"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).1.contains("matmul_epilogue_fusion"),
        "{}",
        text(&o).1
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn doctor_reports_the_machine() {
    let o = graphrun(&["doctor"]);
    let out = text(&o).0;
    assert!(o.status.success());
    assert!(
        out.contains("cpu:")
            && out.contains("cuda")
            && out.contains("wgpu")
            && out.contains("default"),
        "{out}"
    );
}

#[test]
fn dtype_flag_runs_in_half_precision() {
    for dt in ["f16", "bf16"] {
        let o = graphrun(&["models/mlp.yaml", "--dtype", dt, "--dim", "batch=8"]);
        assert!(o.status.success(), "{}", text(&o).1);
        assert!(
            text(&o).0.contains(&format!("logits: {dt} [8, 10]")),
            "{}",
            text(&o).0
        );
    }
}

/// The sum of a gradient file's elements.
fn grad_sum(path: &Path) -> f64 {
    graphrun::Tensor::read_npy(path)
        .unwrap()
        .to_f64_vec()
        .iter()
        .sum()
}

#[test]
fn backward_writes_every_gradient_under_grads() {
    let d = tmpdir("bwd");
    let dir = d.to_str().unwrap();
    let o = graphrun(&[
        "models/mlp.yaml",
        "--dim",
        "batch=4",
        "--backward",
        "--out-dir",
        dir,
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("grad w1: f32 [784, 512]"), "{out}");
    assert_eq!(files_in(&d), ["grads", "logits.npy", "loss.npy"]);
    // Every floating graph input and every trainable initializer, nothing else.
    assert_eq!(
        files_in(&d.join("grads")),
        ["b1.npy", "b2.npy", "b3.npy", "w1.npy", "w2.npy", "w3.npy", "x.npy"]
    );
    // The model has a training loss: that is what is differentiated, and it says so.
    assert!(
        err.contains("gradients of 'loss' (seeded with ones), the model's training loss"),
        "{err}"
    );
    // The softmax cross-entropy's gradient rows sum to zero, so does the last bias's.
    let s = grad_sum(&d.join("grads/b3.npy"));
    assert!(s.abs() < 1e-5, "sum of b3's gradient {s}");

    // --loss logits: the sum of the logits, whose bias gradient is 1 per row and class.
    let d2 = d.join("logits");
    let o = graphrun(&[
        "models/mlp.yaml",
        "--dim",
        "batch=4",
        "--backward",
        "--loss",
        "logits",
        "--out-dir",
        d2.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(
        text(&o).1.contains("gradients of 'logits'"),
        "{}",
        text(&o).1
    );
    let s = grad_sum(&d2.join("grads/b3.npy"));
    assert!((s - 40.0).abs() < 1e-3, "sum of b3's gradient {s}");

    // A seed from a file: zeros for logits give zero gradients.
    let z = graphrun::Tensor::from_vec(&[4, 10], vec![0f32; 40]).unwrap();
    z.write_npy(&d.join("z.npy")).unwrap();
    let seed = format!("logits={}", d.join("z.npy").display());
    let d3 = d.join("seeded");
    let o = graphrun(&[
        "models/mlp.yaml",
        "--dim",
        "batch=4",
        "--backward",
        "--loss",
        "logits",
        "--grad",
        &seed,
        "--out-dir",
        d3.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    assert!(
        text(&o).1.contains("'logits' (seeded from --grad)"),
        "{}",
        text(&o).1
    );
    let s = grad_sum(&d3.join("grads/w1.npy"));
    assert_eq!(s, 0.0, "a zero seed gives zero gradients");

    // A seed for an output that is not differentiated, a seed of the wrong shape, an
    // unknown --loss, --loss or --grad without --backward: usage errors.
    let bad = graphrun(&[
        "models/mlp.yaml",
        "--dim",
        "batch=4",
        "--backward",
        "--grad",
        &seed,
    ]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad).1);
    assert!(text(&bad).1.contains("--loss logits"), "{}", text(&bad).1);
    let bad = graphrun(&[
        "models/mlp.yaml",
        "--dim",
        "batch=5",
        "--backward",
        "--loss",
        "logits",
        "--grad",
        &seed,
    ]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad).1);
    assert!(text(&bad).1.contains("logits"), "{}", text(&bad).1);
    let bad = graphrun(&["models/mlp.yaml", "--backward", "--loss", "nope"]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad).1);
    assert!(text(&bad).1.contains("logits, loss"), "{}", text(&bad).1);
    let bad = graphrun(&["models/mlp.yaml", "--loss", "loss"]);
    assert_eq!(bad.status.code(), Some(2));
    let bad = graphrun(&["models/mlp.yaml", "--grad", &seed]);
    assert_eq!(bad.status.code(), Some(2));

    // No training section: every floating output is seeded, and named.
    let o = graphrun(&["tests/data/unbound.yaml", "--dim", "n=3", "--backward"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("grad x: f32 [3, 4]"), "{out}");
    assert!(
        err.contains("gradients of the sum of every floating output: 'y' (seeded with ones)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn verify_fusion_checks_gradients_too() {
    let o = graphrun(&[
        "models/gpt_block.yaml",
        "--dim",
        "batch=1",
        "--dim",
        "seq=16",
        "--backward",
        "--verify-fusion",
        "-q",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("verify-fusion grad "), "{out}");
    assert!(!out.contains("FAILED"), "{out}");
}

#[test]
fn verify_fusion_passes_on_every_model() {
    // Every model in models/ (read from the folder, so a new model is covered), forward
    // and backward, at small sizes (only the dims each model has: another is an error).
    let mut models: Vec<PathBuf> = std::fs::read_dir("models")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    models.sort();
    assert!(models.len() >= 4, "{models:?}");
    for m in &models {
        let symbols = graphrun::Model::load(m).unwrap().graph.symbols();
        let m = m.to_str().unwrap();
        let mut args = vec![m, "--backward", "--verify-fusion", "-q"];
        for d in ["batch=1", "seq=8", "heads=2"] {
            if symbols.iter().any(|s| d.starts_with(&format!("{s}="))) {
                args.extend(["--dim", d]);
            }
        }
        let o = graphrun(&args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{m}: {out}{err}");
        let checks = out
            .lines()
            .filter(|l| l.starts_with("verify-fusion "))
            .count();
        assert!(checks >= 2, "{m}: {out}");
        assert!(
            out.lines()
                .filter(|l| l.starts_with("verify-fusion "))
                .all(|l| l.ends_with(" ok")),
            "{m}: {out}"
        );
    }
}

#[test]
fn inspect_backward_prints_the_backward_graph_and_its_memory() {
    let d = tmpdir("inspect_bwd");
    let y = d.join("bwd.yaml");
    let o = graphrun(&[
        "inspect",
        "models/mlp.yaml",
        "--backward",
        "--emit-yaml",
        y.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("backward graph:") && out.contains("FusedMatMulGrad 3"),
        "{out}"
    );
    assert!(out.contains("keeping every forward value"), "{out}");
    // The written backward graph loads and runs like any model.
    let o = graphrun(&[y.to_str().unwrap(), "-q"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("w1.grad: f32 [784, 512]"), "{out}");
    // The mlp has no op that blocks a gradient; a rounding map does.
    assert!(!out.contains("treated as constants"), "{out}");
    let m = d.join("floor.yaml");
    std::fs::write(
        &m,
        "graphrun: 1\nname: floor\ninputs:\n  - {name: x, dtype: f32, shape: [4]}\n\
         outputs: [y]\nnodes:\n  - {op: Floor, inputs: [x], outputs: [f], name: fl}\n  \
         - {op: Mul, inputs: [f, x], outputs: [y], name: mul}\n",
    )
    .unwrap();
    let o = graphrun(&["inspect", m.to_str().unwrap(), "--backward"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains("treated as constants (no gradient flows through them): 'fl' (Floor)"),
        "{out}"
    );
}

#[test]
fn train_learns_saves_and_plots() {
    let d = tmpdir("train");
    let save = d.join("w.safetensors");
    let plot = d.join("loss.svg");
    let o = graphrun(&[
        "train",
        "models/mlp.yaml",
        "--dim",
        "batch=16",
        "--steps",
        "25",
        "--quiet",
        "--save",
        save.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    // "trained 25 steps in ... s; loss A -> B"
    let line = out
        .lines()
        .find(|l| l.starts_with("trained 25 steps"))
        .expect(&out);
    let nums: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|s| s.parse().ok())
        .collect();
    let (first, last) = (nums[nums.len() - 2], nums[nums.len() - 1]);
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    let texts = svg_texts(&svg);
    for want in ["step", "loss", "training loss, per step"] {
        assert!(texts.iter().any(|t| t == want), "{want:?} in {texts:?}");
    }
    // No held-out data: no held-out curves.
    assert!(!texts.iter().any(|t| t.contains("held-out")), "{texts:?}");
    // The checkpoint loads back as initializers (`file:`).
    let t = graphrun::Tensor::read_safetensors(&save).unwrap();
    let names: Vec<&str> = t.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), 6, "{names:?}");
    let yaml = std::fs::read_to_string("models/mlp.yaml")
        .unwrap()
        .lines()
        .map(|l| {
            let name = ["w1", "b1", "w2", "b2", "w3", "b3"]
                .into_iter()
                .find(|w| l.contains(&format!("{{name: {w},")));
            match name {
                Some(w) => format!("  - {{name: {w}, file: w.safetensors, key: {w}}}"),
                None => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(d.join("trained.yaml"), yaml).unwrap();
    // Same seeded batch as the training run: the trained weights give the trained loss.
    let o = graphrun(&[
        d.join("trained.yaml").to_str().unwrap(),
        "--dim",
        "batch=16",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let loss: f64 = out
        .lines()
        .find(|l| l.starts_with("loss:"))
        .and_then(|l| l.split('[').nth(2))
        .and_then(|v| {
            v.trim_end_matches(|c| c != ']')
                .trim_end_matches(']')
                .parse()
                .ok()
        })
        .expect(&out);
    assert!(
        loss < 0.5 * first,
        "trained model's loss {loss}, first {first}"
    );
    // Without a training section, train is a usage error.
    let o = graphrun(&["train", "tests/data/unbound.yaml"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
}

#[test]
fn bench_fwd_is_inference_and_train_times_the_whole_step() {
    // The reference's `fwd` is the model under no_grad, without the loss: bench leaves
    // the training loss out of its forward pass, and keeps it in the training step.
    let d = tmpdir("bench");
    for (pass, extra) in [("fwd", None), ("train", Some("--backward"))] {
        let json = d.join(format!("{pass}.json"));
        let mut args = vec![
            "bench",
            "models/gpt_block.yaml",
            "--dim",
            "batch=1",
            "--dim",
            "seq=16",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend(extra);
        let o = graphrun(&args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{err}");
        assert!(out.contains(&format!(", {pass}, ")), "{out}");
        let rec = std::fs::read_to_string(&json).unwrap();
        assert!(rec.contains(&format!("\"pass\": \"{pass}\"")), "{rec}");
        // The MSE (node `mse`) runs only in the training step.
        assert_eq!(rec.contains("\"node\": \"mse\""), pass == "train", "{rec}");
    }
}

/// Every `<text>` of an SVG document, which must parse as XML.
fn svg_texts(svg: &str) -> Vec<String> {
    let doc = roxmltree::Document::parse(svg).unwrap_or_else(|e| panic!("{e}: {svg}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_string())
        .collect()
}

#[test]
fn train_plot_draws_held_out_curves_and_a_log_scale() {
    let d = tmpdir("plot");
    // 96 samples of an easy task: the label is 1 where the first pixel is positive.
    let n = 96;
    let mut rng = graphrun::rng::Rng::new(7);
    let x: Vec<f32> = (0..n * 784)
        .map(|_| rng.uniform_in(-1.0, 1.0) as f32)
        .collect();
    let y: Vec<i64> = (0..n).map(|i| (x[i * 784] > 0.0) as i64).collect();
    let xs = d.join("x.npy");
    let ys = d.join("y.npy");
    graphrun::Tensor::from_vec(&[n, 784], x)
        .unwrap()
        .write_npy(&xs)
        .unwrap();
    graphrun::Tensor::from_vec(&[n], y)
        .unwrap()
        .write_npy(&ys)
        .unwrap();
    let (x, y) = (
        format!("x={}", xs.display()),
        format!("labels={}", ys.display()),
    );
    for log in [false, true] {
        let plot = d.join(format!("p{log}.svg"));
        let mut args = vec![
            "train",
            "models/mlp.yaml",
            "--data",
            &x,
            "--data",
            &y,
            "--val-data",
            &x,
            "--val-data",
            &y,
            "--batch-size",
            "16",
            "--epochs",
            "4",
            "--quiet",
            "--plot",
            plot.to_str().unwrap(),
        ];
        if log {
            args.push("--plot-log");
        }
        let o = graphrun(&args);
        assert!(o.status.success(), "{}", text(&o).1);
        let texts = svg_texts(&std::fs::read_to_string(&plot).unwrap());
        for want in [
            "step",
            if log { "loss (log scale)" } else { "loss" },
            "held-out accuracy (%)",
            "training loss, per step",
            "training loss, epoch mean",
            "held-out loss, after each epoch",
            "held-out accuracy, after each epoch",
        ] {
            assert!(texts.iter().any(|t| t == want), "{want:?} in {texts:?}");
        }
        // Ticks: numbers on both axes of the loss panel.
        assert!(
            texts.iter().filter(|t| t.parse::<f64>().is_ok()).count() >= 8,
            "{texts:?}"
        );
    }
    let o = graphrun(&["train", "models/mlp.yaml", "--plot-log"]);
    assert_eq!(o.status.code(), Some(2), "--plot-log needs --plot");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn every_argument_has_help() {
    for cmd in ["run", "inspect", "bench", "train", "convert", "doctor"] {
        let out = text(&graphrun(&[cmd, "--help"])).0;
        let mut checked = 0;
        for line in out.lines() {
            let t = line.trim_start();
            // An argument line: `--flag <V>  help`, `-q, --quiet  help`, `<MODEL>  help`.
            if !(t.starts_with('-') || t.starts_with('<')) || line.len() == t.len() {
                continue;
            }
            checked += 1;
            let help = t.split_once("  ").map(|(_, h)| h.trim()).unwrap_or("");
            assert!(
                !help.is_empty() && !help.starts_with('['),
                "`graphrun {cmd}`: no help for {t:?}"
            );
        }
        assert!(checked >= 2, "{cmd}: {out}");
    }
}

/// An exported language model fine-tuned from the command line: `train --cross-entropy`
/// on a token set (labels as --data), `--save`, then `convert --weights` writes the ONNX
/// file back with the trained weights, which runs; `convert --weights` refuses other
/// file kinds.
#[test]
fn fine_tune_an_export_and_write_its_weights_back() {
    let d = tmpdir("fine_tune");
    let ids = d.join("ids.npy");
    let labels = d.join("labels.npy");
    let batch = graphrun::Tensor::read_npy(Path::new("tests/fixtures/lm_train/ids.npy")).unwrap();
    let lab = graphrun::Tensor::read_npy(Path::new("tests/fixtures/lm_train/labels.npy")).unwrap();
    // [steps, batch, seq] → [steps·batch, seq]
    let flat = |t: graphrun::Tensor| {
        let s = t.shape().to_vec();
        t.reshaped(&[s[0] * s[1], s[2]]).unwrap()
    };
    flat(batch).write_npy(&ids).unwrap();
    flat(lab).write_npy(&labels).unwrap();
    let model = "tests/fixtures/lm_train/gpt2.onnx";
    let saved = d.join("trained.safetensors");
    let o = graphrun(&[
        "train",
        model,
        "--cross-entropy",
        "logits",
        "--data",
        &format!("input_ids={}", ids.display()),
        "--data",
        &format!("labels={}", labels.display()),
        "--batch-size",
        "8",
        "--epochs",
        "3",
        "--lr",
        "0.003",
        "-q",
        "--save",
        saved.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    // "trained N steps in T s; loss FIRST -> LAST"
    let line = out.lines().find(|l| l.starts_with("trained ")).unwrap();
    let losses: Vec<f64> = line
        .rsplit("loss ")
        .next()
        .unwrap()
        .split(" -> ")
        .map(|v| v.trim().parse().unwrap())
        .collect();
    assert!(losses[1] < losses[0] - 0.3, "the loss falls: {out}");
    let written = d.join("trained.onnx");
    let o = graphrun(&[
        "convert",
        model,
        "--weights",
        saved.to_str().unwrap(),
        "-o",
        written.to_str().unwrap(),
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(out.contains("val_374 derived"), "{out}");
    let o = graphrun(&[
        written.to_str().unwrap(),
        "--input",
        &format!("input_ids={}", ids.display()),
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = graphrun(&[
        "convert",
        model,
        "--weights",
        saved.to_str().unwrap(),
        "-o",
        "x.yaml",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("must be .onnx files"), "{:?}", text(&o));
}

/// An LSTM exported with a dynamic sequence axis is unrolled for the length the command
/// will feed: `run` takes it from the `--input` file, `inspect` from `--dim`, and without
/// either the error names the node and the fix.
#[test]
fn recurrences_take_their_length_from_what_is_fed() {
    let z = Path::new("tests/fixtures/zoo/lstm_lm_torchscript_op17");
    let model = z.join("model.onnx");
    let model = model.to_str().unwrap();
    let ids = z.join("in_input_ids.npy");
    let d = tmpdir("cli_lstm");
    let o = graphrun(&[
        model,
        "--input",
        &format!("input_ids={}", ids.display()),
        "--out-dir",
        d.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    let got = graphrun::Tensor::read_npy(&d.join("logits.npy"))
        .unwrap()
        .to_f64_vec();
    let want = graphrun::Tensor::read_npy(&z.join("ort_0.npy"))
        .unwrap()
        .to_f64_vec();
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(err < 1e-4, "logits differ from ONNX Runtime's by {err}");

    let o = graphrun(&["inspect", model]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("LSTM") && err.contains("sequence length") && err.contains("--dim"),
        "{err}"
    );

    let o = graphrun(&["inspect", model, "--dim", "sequence=6", "--dim", "batch=2"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("input_ids i64[2, 6]"), "{out}");
}

/// A narrow type's output is written to .npy as its bytes (u8 or i8), and such a file
/// feeds an input of that type; values outside a narrow integer's range are refused.
#[test]
fn narrow_types_round_trip_through_npy_files() {
    let d = tmpdir("narrow");
    let model = d.join("m.yaml");
    std::fs::write(
        &model,
        "graphrun: 1\ninputs:\n  - {name: q, dtype: f8e4m3fn, shape: [4]}\n  - {name: k, dtype: i4, shape: [3]}\n\
         outputs: [y, z, back]\nnodes:\n  - {op: Cast, inputs: [q], outputs: [y], attrs: {to: f32}}\n\
         \x20 - {op: Cast, inputs: [k], outputs: [z], attrs: {to: f32}}\n\
         \x20 - {op: Cast, inputs: [y], outputs: [back], attrs: {to: f8e4m3fn}}\n",
    )
    .unwrap();
    // E4M3FN patterns of 1, -2, 0.5 and 448.
    let q = graphrun::Tensor::from_vec(&[4], vec![0x38u8, 0xc0, 0x30, 0x7e]).unwrap();
    q.write_npy(&d.join("q.npy")).unwrap();
    let k = graphrun::Tensor::from_vec(&[3], vec![-8i8, 7, 0]).unwrap();
    k.write_npy(&d.join("k.npy")).unwrap();
    let out = d.join("out");
    let (qa, ka) = (
        format!("q={}", d.join("q.npy").display()),
        format!("k={}", d.join("k.npy").display()),
    );
    let o = graphrun(&[
        model.to_str().unwrap(),
        "--input",
        &qa,
        "--input",
        &ka,
        "--out-dir",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    let y = graphrun::Tensor::read_npy(&out.join("y.npy")).unwrap();
    assert_eq!(y.to_f64_vec(), vec![1.0, -2.0, 0.5, 448.0]);
    let z = graphrun::Tensor::read_npy(&out.join("z.npy")).unwrap();
    assert_eq!(z.to_f64_vec(), vec![-8.0, 7.0, 0.0]);
    // The written bytes feed the input again.
    let back = format!("q={}", out.join("back.npy").display());
    let o = graphrun(&[
        model.to_str().unwrap(),
        "--input",
        &back,
        "--input",
        &ka,
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    let bad = graphrun::Tensor::from_vec(&[3], vec![-9i8, 7, 0]).unwrap();
    bad.write_npy(&d.join("bad.npy")).unwrap();
    let kb = format!("k={}", d.join("bad.npy").display());
    let o = graphrun(&[model.to_str().unwrap(), "--input", &qa, "--input", &kb]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(
        text(&o).1.contains("i4") && text(&o).1.contains("-9"),
        "{}",
        text(&o).1
    );
    let _ = std::fs::remove_dir_all(&d);
}
