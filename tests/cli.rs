//! The command line (SPEC §5): what it prints, what it writes, and its exit codes.

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
fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("graphrun_cli_{tag}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
fn files_in(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .map(|r| {
            r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
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
    for b in ["cuda", "wgpu"] {
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
    // Unbound symbols are named.
    let o = graphrun(&["inspect", "tests/data/unbound.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("'n'"), "{}", text(&o).1);
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
