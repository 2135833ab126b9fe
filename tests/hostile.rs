//! Hostile files and bad numbers: what graphrun writes, reads and trains on when the user
//! (or a model file) is out to break it. Each test reproduces one defect found by probing
//! and holds its fix (docs/RELIABILITY.md lists them).

#[path = "common/dirs.rs"]
mod dirs;
use dirs::*;

mod common;

use graphrun::onnx::proto::{
    GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto, TensorProto,
    ValueInfoProto,
};
use graphrun::Tensor;
use prost::Message;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::process::{Command, Output};

fn graphrun_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_graphrun"));
    c.args(args).env_remove("GRAPHRUN_MAX_BYTES");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}
fn graphrun(args: &[&str]) -> Output {
    graphrun_env(args, &[])
}
fn err_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
fn out_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}
/// Fails with the command's output unless it exited with `code` and its stderr holds
/// every one of `parts`.
fn expect(o: &Output, code: i32, parts: &[&str]) {
    let e = err_of(o);
    assert_eq!(o.status.code(), Some(code), "{}{e}", out_of(o));
    for p in parts {
        assert!(e.contains(p), "stderr lacks {p:?}:\n{e}");
    }
}

/// A small model with one weight read from `file` (a path as the model writes it).
fn model_reading(file: &str) -> String {
    format!(
        "graphrun: 1\nname: m\ninputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [y]\n\
         initializers:\n  - {{name: w, file: {file}}}\nnodes:\n  - {{op: Add, inputs: [x, w], outputs: [y]}}\n"
    )
}

// ---- files: touch nothing the user did not name --------------------------------------

#[test]
fn outputs_replace_a_symlink_and_never_write_through_it() {
    let d = tmpdir("symlink");
    std::fs::write(d.join("victim"), "keep me").unwrap();
    for name in ["y.npy", "loss.npy", "logits.npy"] {
        symlink(d.join("victim"), d.join(name)).unwrap();
    }
    let o = graphrun(&["models/mlp.yaml", "--out-dir", s(&d), "-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(
        std::fs::read_to_string(d.join("victim")).unwrap(),
        "keep me"
    );
    let m = std::fs::symlink_metadata(d.join("logits.npy")).unwrap();
    assert!(
        m.file_type().is_file(),
        "the output is a file, not the planted link"
    );
    // Nothing else is left in the folder (no temporary files).
    assert_eq!(
        files_in(&d),
        ["logits.npy", "loss.npy", "victim", "y.npy"],
        "{:?}",
        files_in(&d)
    );
    // A planted link under the target of --dot, --save-like single outputs too.
    symlink(d.join("victim"), d.join("g.dot")).unwrap();
    let o = graphrun(&["inspect", "models/mlp.yaml", "--dot", s(&d.join("g.dot"))]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(
        std::fs::read_to_string(d.join("victim")).unwrap(),
        "keep me"
    );
    assert!(std::fs::read_to_string(d.join("g.dot"))
        .unwrap()
        .contains("digraph"));
}

#[test]
fn a_254_byte_output_name_works() {
    let d = tmpdir("longname");
    let name = format!("{}.dot", "n".repeat(250));
    let p = d.join(&name);
    let o = graphrun(&["inspect", "models/mlp.yaml", "--dot", s(&p)]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(files_in(&d), [name]);
    // One byte longer than file systems take: refused before any work, by name.
    let p = d.join(format!("{}.dot", "n".repeat(252)));
    expect(
        &graphrun(&["inspect", "models/mlp.yaml", "--dot", s(&p)]),
        2,
        &["256 bytes long"],
    );
}

#[test]
fn model_files_stay_inside_the_model_folder() {
    let d = tmpdir("inside");
    let sub = d.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let w = Tensor::from_vec(&[2], vec![1.0f32, 2.0]).unwrap();
    w.write_npy(&d.join("outside.npy")).unwrap();
    symlink(d.join("outside.npy"), sub.join("link.npy")).unwrap();
    symlink(&d, sub.join("up")).unwrap();
    let abs = d.join("outside.npy");
    for file in [
        "../outside.npy",
        abs.to_str().unwrap(),
        "link.npy",
        "up/outside.npy",
    ] {
        std::fs::write(sub.join("m.yaml"), model_reading(file)).unwrap();
        let o = graphrun(&[s(&sub.join("m.yaml")), "-q"]);
        expect(
            &o,
            2,
            &["outside the model's folder", "--allow-outside-files"],
        );
        // The opt-in reads it.
        let o = graphrun(&[s(&sub.join("m.yaml")), "-q", "--allow-outside-files"]);
        assert!(o.status.success(), "{file}: {}", err_of(&o));
    }
    // Inside the folder (through a link that stays inside) is fine.
    w.write_npy(&sub.join("w.npy")).unwrap();
    symlink(sub.join("w.npy"), sub.join("inner.npy")).unwrap();
    std::fs::write(sub.join("m.yaml"), model_reading("inner.npy")).unwrap();
    let o = graphrun(&[s(&sub.join("m.yaml")), "-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
}

fn external_tensor(location: &str, n: i64) -> TensorProto {
    let e = |k: &str, v: &str| StringStringEntryProto {
        key: k.into(),
        value: v.into(),
    };
    TensorProto {
        name: "w".into(),
        dims: vec![n],
        data_type: 1,
        data_location: 1,
        external_data: vec![e("location", location), e("length", &(4 * n).to_string())],
        ..Default::default()
    }
}

/// An .onnx model whose output is the initializer `w` (external data at `location`).
fn write_onnx(path: &Path, w: TensorProto) {
    let output = |name: &str| ValueInfoProto {
        name: name.into(),
        r#type: None,
    };
    let g = GraphProto {
        initializer: vec![w],
        node: vec![NodeProto {
            op_type: "Identity".into(),
            input: vec!["w".into()],
            output: vec!["y".into()],
            ..Default::default()
        }],
        output: vec![output("y")],
        ..Default::default()
    };
    let m = ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: 17,
        }],
        graph: Some(g),
        ..Default::default()
    };
    std::fs::write(path, m.encode_to_vec()).unwrap();
}

#[test]
fn external_data_through_a_symlink_out_of_the_folder_is_refused() {
    let d = tmpdir("extlink");
    let sub = d.join("model");
    std::fs::create_dir_all(&sub).unwrap();
    std::fs::write(d.join("secret.bin"), 1.5f32.to_le_bytes().repeat(4)).unwrap();
    symlink(d.join("secret.bin"), sub.join("w.bin")).unwrap();
    write_onnx(&sub.join("m.onnx"), external_tensor("w.bin", 4));
    expect(
        &graphrun(&[s(&sub.join("m.onnx")), "-q"]),
        2,
        &["outside the model's folder", "secret.bin"],
    );
    // A symlinked folder leading out is refused the same way.
    std::fs::create_dir_all(d.join("elsewhere")).unwrap();
    std::fs::copy(d.join("secret.bin"), d.join("elsewhere/w.bin")).unwrap();
    symlink(d.join("elsewhere"), sub.join("data")).unwrap();
    write_onnx(&sub.join("m2.onnx"), external_tensor("data/w.bin", 4));
    expect(
        &graphrun(&[s(&sub.join("m2.onnx")), "-q"]),
        2,
        &["outside the model's folder"],
    );
    let o = graphrun(&[s(&sub.join("m2.onnx")), "-q", "--allow-outside-files"]);
    assert!(o.status.success(), "{}", err_of(&o));
}

#[test]
fn emit_yaml_never_replaces_a_file_the_run_reads() {
    let d = tmpdir("emit");
    let w = Tensor::from_vec(&[100], (0..100).map(|i| i as f32).collect()).unwrap();
    graphrun::Tensor::write_safetensors(&[("w".into(), &w)], &d.join("emit.safetensors")).unwrap();
    let text = "graphrun: 1\nname: m\ninputs: [{name: x, dtype: f32, shape: [100]}]\noutputs: [y]\n\
         initializers:\n  - {name: w, file: emit.safetensors}\nnodes:\n  - {op: Add, inputs: [x, w], outputs: [y]}\n";
    std::fs::write(d.join("m.yaml"), text).unwrap();
    let before = std::fs::read(d.join("emit.safetensors")).unwrap();
    let o = graphrun(&[
        "inspect",
        s(&d.join("m.yaml")),
        "--emit-yaml",
        s(&d.join("emit.yaml")),
    ]);
    expect(&o, 2, &["emit.safetensors", "this run reads"]);
    assert_eq!(std::fs::read(d.join("emit.safetensors")).unwrap(), before);
    assert!(!d.join("emit.yaml").exists());
    // Replacing the model file itself is refused too.
    let o = graphrun(&["convert", s(&d.join("m.yaml")), "-o", s(&d.join("m.yaml"))]);
    expect(&o, 2, &["this run reads"]);
    // And --input files.
    let x = Tensor::from_vec(&[64, 784], vec![0.5f32; 64 * 784]).unwrap();
    x.write_npy(&d.join("x.npy")).unwrap();
    let o = graphrun(&[
        "models/mlp.yaml",
        "--input",
        &format!("x={}", s(&d.join("x.npy"))),
        "--random-inputs",
        "--out-dir",
        s(&d),
    ]);
    assert!(o.status.success(), "{}", err_of(&o));
    let o = graphrun(&[
        "train",
        "models/mlp.yaml",
        "--steps",
        "1",
        "-q",
        "--save",
        s(&d.join("x.npy")),
    ]);
    assert!(
        o.status.success(),
        "a file not read by this run may be replaced"
    );
}

#[test]
fn a_failing_run_leaves_nothing_behind() {
    // --out-dir whose grads folder is a file: refused before running, y.npy not written.
    let d = tmpdir("partial");
    let out = d.join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("grads"), "").unwrap();
    let o = graphrun(&["models/mlp.yaml", "--backward", "--out-dir", s(&out), "-q"]);
    expect(&o, 2, &["grads", "is a file"]);
    assert_eq!(files_in(&out), ["grads"]);
    // --emit-yaml at a folder: no side file either.
    let e = d.join("e");
    std::fs::create_dir_all(e.join("o.yaml")).unwrap();
    let onnx = "tests/fixtures/onnx/gpt_block_explicit_torchscript/model.onnx";
    let o = graphrun(&["inspect", onnx, "--emit-yaml", s(&e.join("o.yaml"))]);
    expect(&o, 2, &["is a folder"]);
    assert_eq!(files_in(&e), ["o.yaml"]);
    // train --save into a missing folder fails at once, before any training step.
    let t0 = std::time::Instant::now();
    let o = graphrun(&[
        "train",
        "models/mlp.yaml",
        "--steps",
        "100000",
        "--save",
        s(&d.join("nope/ck.safetensors")),
    ]);
    expect(&o, 2, &["does not exist"]);
    assert!(t0.elapsed().as_secs() < 30, "refused before training");
    assert!(
        !err_of(&o).contains(".gr"),
        "names the output, not a temporary"
    );
    // A --plot that cannot be written does not let --save go ahead alone.
    let o = graphrun(&[
        "train",
        "models/mlp.yaml",
        "--steps",
        "1",
        "-q",
        "--plot",
        s(&e.join("o.yaml")),
        "--save",
        s(&d.join("ck.safetensors")),
    ]);
    expect(&o, 2, &["is a folder"]);
    assert!(!d.join("ck.safetensors").exists());
    // A --out-dir that is made for the outputs is removed again when writing fails.
    let o = graphrun(&[
        "models/mlp.yaml",
        "-q",
        "--out-dir",
        s(&d.join("new/deeper")),
        "--dim",
        "batch=2",
    ]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(files_in(&d.join("new/deeper")), ["logits.npy", "loss.npy"]);
}

// ---- memory: refuse before allocating ------------------------------------------------

/// The header of a .npy file of f32 `shape` with no data after it.
fn npy_header_only(shape: &str) -> Vec<u8> {
    let mut h = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out
}

#[test]
fn the_memory_cap_holds_before_anything_is_read() {
    let d = tmpdir("cap");
    // A header claiming 512 MiB: refused by the cap (naming input, dtype and shape),
    // not read until the data runs out.
    std::fs::write(d.join("big.npy"), npy_header_only("(134217728,)")).unwrap();
    let x = format!("x={}", s(&d.join("big.npy")));
    let o = graphrun(&["--max-memory", "256M", "models/mlp.yaml", "--input", &x]);
    expect(&o, 2, &["--input x", "f32 [134217728]", "memory limit"]);
    // The environment variable works the same, and a bad value is an error.
    let o = graphrun_env(
        &["models/mlp.yaml", "--input", &x],
        &[("GRAPHRUN_MAX_BYTES", "256M")],
    );
    expect(&o, 2, &["memory limit"]);
    let o = graphrun_env(&["models/mlp.yaml"], &[("GRAPHRUN_MAX_BYTES", "lots")]);
    expect(&o, 2, &["GRAPHRUN_MAX_BYTES", "'lots' is not a size"]);
    // A device is read only as far as its header.
    let o = graphrun(&["models/mlp.yaml", "--input", "x=/dev/zero"]);
    expect(&o, 2, &["/dev/zero", "not a valid .npy"]);
    // 12 GiB of external data with a 1 GiB cap: refused before allocating, by inspect too.
    let n: i64 = 3 << 30;
    write_onnx(&d.join("huge.onnx"), external_tensor("huge.bin", n));
    std::fs::File::create(d.join("huge.bin"))
        .unwrap()
        .set_len(4 * n as u64)
        .unwrap();
    let huge = d.join("huge.onnx");
    for cmd in [vec![], vec!["inspect"]] {
        let mut args = cmd.clone();
        args.extend(["--max-memory", "1G", s(&huge)]);
        expect(&graphrun(&args), 2, &["initializer 'w'", "memory limit"]);
    }
    // A dim that makes an input too large names the input and its shape.
    let o = graphrun(&["models/mlp.yaml", "--dim", "batch=1000000000000"]);
    expect(
        &o,
        2,
        &["input 'x'", "[1000000000000, 784]", "memory limit"],
    );
}

#[test]
fn plans_for_a_hundred_thousand_inputs_are_near_linear() {
    // Buffer placement and input checks were quadratic in the graph's inputs: 20 000
    // inputs took 1.8 s and 100 000 did not finish in a minute.
    let n = 100_000;
    let mut text = String::from("graphrun: 1\nname: wide\ninputs:\n");
    for i in 0..n {
        text.push_str(&format!("  - {{name: x{i}, dtype: f32, shape: [1]}}\n"));
    }
    let names: Vec<String> = (0..n).map(|i| format!("x{i}")).collect();
    text.push_str(&format!(
        "outputs: [y]\nnodes:\n  - {{op: Concat, inputs: [{}], outputs: [y], attrs: {{axis: 0}}}}\n",
        names.join(", ")
    ));
    let m = graphrun::Model::from_str(&text, ".").unwrap();
    let t0 = std::time::Instant::now();
    let mut sess = graphrun::Session::new(m.graph, Default::default()).unwrap();
    let feeds: std::collections::HashMap<String, Tensor> = names
        .iter()
        .enumerate()
        .map(|(i, k)| (k.clone(), Tensor::from_vec(&[1], vec![i as f32]).unwrap()))
        .collect();
    let y = &sess.run(&feeds).unwrap()[0].1;
    assert_eq!(y.shape(), [n]);
    assert_eq!(y.to_f64_vec()[n - 1], (n - 1) as f64);
    // Not a timing assertion of the kernels: a generous bound that only a quadratic
    // plan misses (it took minutes).
    assert!(t0.elapsed().as_secs() < 60, "{:?}", t0.elapsed());
}

// ---- training: no silent NaN, no invalid hyper-parameters ----------------------------

/// A classifier whose loss ignores label -1 (`ignore_index`), trained with SGD.
const IGNORING: &str = "graphrun: 1\nname: clf\ndims: {batch: 4}\ninputs:\n  \
  - {name: x, dtype: f32, shape: [batch, 3]}\n  - {name: labels, dtype: i64, shape: [batch]}\n\
outputs: [loss]\ninitializers:\n  - {name: w, dtype: f32, shape: [3, 2], init: {dist: normal, seed: 1}}\n\
nodes:\n  - {op: MatMul, inputs: [x, w], outputs: [logits]}\n  \
  - {op: SoftmaxCrossEntropyLoss, inputs: [logits, labels], outputs: [loss], attrs: {ignore_index: -1}}\n\
training: {loss: loss, optimizer: {sgd: {lr: 0.1}}}\n";

#[test]
fn a_nan_reaching_the_weights_stops_training_and_is_not_saved() {
    let d = tmpdir("nan");
    std::fs::write(d.join("m.yaml"), IGNORING).unwrap();
    // Sample 2 holds a NaN and its label is ignored: the loss stays finite, the
    // gradient of w does not.
    let mut x: Vec<f32> = (0..12).map(|i| (i as f32 * 0.3).sin()).collect();
    x[7] = f32::NAN;
    Tensor::from_vec(&[4, 3], x)
        .unwrap()
        .write_npy(&d.join("x.npy"))
        .unwrap();
    Tensor::from_vec(&[4], vec![0i64, 1, -1, 0])
        .unwrap()
        .write_npy(&d.join("y.npy"))
        .unwrap();
    let args = |extra: &[&str]| {
        let mut v = vec![
            "train".to_string(),
            d.join("m.yaml").display().to_string(),
            "--data".into(),
            format!("x={}", d.join("x.npy").display()),
            "--data".into(),
            format!("labels={}", d.join("y.npy").display()),
            "--steps".into(),
            "3".into(),
            "-q".into(),
            "--save".into(),
            d.join("ck.safetensors").display().to_string(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let a = args(&[]);
    let o = graphrun(&a.iter().map(String::as_str).collect::<Vec<_>>());
    expect(
        &o,
        1,
        &["training step 1", "parameter 'w'", "NaN or infinite"],
    );
    assert!(!d.join("ck.safetensors").exists());
    // Asked for, it goes on and saves.
    let a = args(&["--allow-nonfinite"]);
    let o = graphrun(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", err_of(&o));
    let saved = Tensor::read_safetensors(&d.join("ck.safetensors")).unwrap();
    assert!(saved[0].1.to_f64_vec().iter().any(|v| v.is_nan()));
}

#[test]
fn the_library_reports_the_first_nonfinite_parameter_on_every_backend() {
    let m = graphrun::Model::from_str(IGNORING, ".").unwrap();
    let mut x: Vec<f32> = (0..12).map(|i| (i as f32 * 0.3).sin()).collect();
    x[7] = f32::NAN;
    let feeds: std::collections::HashMap<String, Tensor> = [
        ("x".to_string(), Tensor::from_vec(&[4, 3], x).unwrap()),
        (
            "labels".to_string(),
            Tensor::from_vec(&[4], vec![0i64, 1, -1, 0]).unwrap(),
        ),
    ]
    .into();
    for backend in common::backends() {
        let opts = graphrun::SessionOptions {
            backend,
            ..graphrun::SessionOptions::unfused()
        };
        let mut s = graphrun::Session::new(m.graph.clone(), opts).unwrap();
        let e = s.train_step(&feeds).unwrap_err().to_string();
        assert!(
            e.contains("parameter 'w'") && e.contains("step 1"),
            "{backend:?}: {e}"
        );
        // Finite data trains without a word.
        let mut ok = feeds.clone();
        ok.insert(
            "labels".into(),
            Tensor::from_vec(&[4], vec![0i64, 1, 1, 0]).unwrap(),
        );
        ok.insert(
            "x".into(),
            Tensor::from_vec(&[4, 3], (0..12).map(|i| i as f32 * 0.1).collect()).unwrap(),
        );
        let opts = graphrun::SessionOptions {
            backend,
            ..graphrun::SessionOptions::unfused()
        };
        let mut s = graphrun::Session::new(m.graph.clone(), opts).unwrap();
        for _ in 0..3 {
            assert!(s.train_step(&ok).unwrap().is_finite());
        }
    }
}

#[test]
fn hyper_parameters_are_checked_as_pytorch_checks_them() {
    let d = tmpdir("hyper");
    for lr in ["nan", "inf", "0", "-0.1"] {
        let flag = format!("--lr={lr}");
        let o = graphrun(&["train", "models/mlp.yaml", "--steps", "1", "-q", &flag]);
        expect(&o, 2, &["--lr", "lr must be a finite number > 0"]);
    }
    let bad = [
        ("{sgd: {lr: .nan}}", "lr must be"),
        ("{sgd: {lr: 0.1, momentum: -1}}", "momentum must be"),
        (
            "{sgd: {lr: 0.1, weight_decay: .inf}}",
            "weight_decay must be",
        ),
        ("{adam: {beta1: 1.0}}", "beta1 must be in [0, 1)"),
        ("{adam: {beta2: -0.5}}", "beta2 must be in [0, 1)"),
        ("{adamw: {eps: 0}}", "eps must be"),
    ];
    for (opt, msg) in bad {
        let text = IGNORING.replace("{sgd: {lr: 0.1}}", opt);
        std::fs::write(d.join("m.yaml"), &text).unwrap();
        let o = graphrun(&["inspect", s(&d.join("m.yaml"))]);
        expect(&o, 2, &[msg, "m.yaml:"]);
    }
    // init std/bounds and input ranges are finite numbers.
    for (from, to, msg) in [
        (
            "{dist: normal, seed: 1}",
            "{dist: normal, seed: 1, std: .inf}",
            "std must be a finite",
        ),
        (
            "{dist: normal, seed: 1}",
            "{dist: uniform, seed: 1, low: .nan}",
            "low must be a finite",
        ),
        (
            "shape: [batch]}",
            "shape: [batch], range: [0, .inf]}",
            "range high must be a finite",
        ),
    ] {
        std::fs::write(d.join("m.yaml"), IGNORING.replace(from, to)).unwrap();
        let o = graphrun(&["inspect", s(&d.join("m.yaml"))]);
        expect(&o, 2, &[msg]);
    }
}

#[test]
fn the_training_loss_must_be_a_scalar() {
    let d = tmpdir("scalar");
    let text = IGNORING
        .replace("training: {loss: loss", "training: {loss: logits")
        .replace("\noutputs: [loss]\n", "\noutputs: [loss, logits]\n");
    std::fs::write(d.join("m.yaml"), text).unwrap();
    let o = graphrun(&["train", s(&d.join("m.yaml")), "--steps", "1", "-q"]);
    expect(
        &o,
        2,
        &["training loss 'logits' must be a floating scalar", "[4, 2]"],
    );
    let o = graphrun(&[
        "train",
        "models/mlp.yaml",
        "--loss",
        "logits",
        "--steps",
        "1",
    ]);
    expect(&o, 2, &["must be a floating scalar"]);
}

// ---- command line and messages -------------------------------------------------------

#[test]
fn command_line_mistakes_are_errors() {
    // A --dim for a symbol the model does not have names the model's symbols.
    let o = graphrun(&["models/mlp.yaml", "--dim", "batchsize=2"]);
    expect(&o, 2, &["batchsize", "its symbolic dims are batch"]);
    // Global options before the model work as after it.
    let o = graphrun(&[
        "--max-memory",
        "1G",
        "models/mlp.yaml",
        "--dim",
        "batch=2",
        "-q",
    ]);
    assert!(o.status.success(), "{}", err_of(&o));
    let o = graphrun(&["--max-memory=1K", "models/mlp.yaml"]);
    expect(&o, 2, &["memory limit"]);
}

#[test]
fn messages_say_what_is_wrong() {
    let d = tmpdir("msgs");
    // A UTF-8 byte-order mark is accepted.
    let mut bom = b"\xef\xbb\xbf".to_vec();
    bom.extend(std::fs::read("models/mlp.yaml").unwrap());
    std::fs::write(d.join("bom.yaml"), bom).unwrap();
    let o = graphrun(&[s(&d.join("bom.yaml")), "--dim", "batch=2", "-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let one = |init: &str, node: &str| {
        format!(
            "graphrun: 1\nname: m\ninputs: [{{name: x, dtype: i64, shape: [2]}}]\noutputs: [y]\n\
             initializers:\n  - {init}\nnodes:\n  - {node}\n"
        )
    };
    let add = "{op: Add, inputs: [x, w], outputs: [y]}";
    let cases = [
        (
            one("{name: w, dtype: i64, shape: [2], values: [1e30, 2]}", add),
            vec!["1e30 is out of the i64 range"],
        ),
        (
            one("{name: w, dtype: i8, shape: [2], values: [300, 2]}", add),
            vec!["300 is out of the i8 range [-128, 127]"],
        ),
        (
            one(
                "{name: w, dtype: f32, shape: [4294967296, 4294967296, 4294967296], init: zeros}",
                add,
            ),
            vec!["initializer 'w'", "too large", "m.yaml:6:"],
        ),
    ];
    for (text, parts) in cases {
        std::fs::write(d.join("m.yaml"), text).unwrap();
        expect(&graphrun(&[s(&d.join("m.yaml"))]), 2, &parts);
    }
    // A million-element attribute is not echoed back.
    let perm = vec!["1"; 1_000_000].join(",");
    let text = format!(
        "graphrun: 1\nname: m\ninputs: [{{name: x, dtype: f32, shape: [2, 3]}}]\noutputs: [y]\n\
         nodes:\n  - {{op: Transpose, inputs: [x], outputs: [y], attrs: {{perm: [{perm}]}}}}\n"
    );
    std::fs::write(d.join("m.yaml"), text).unwrap();
    let o = graphrun(&[s(&d.join("m.yaml"))]);
    expect(&o, 2, &["perm", "(1000000 values)"]);
    assert!(err_of(&o).len() < 1000, "{}", err_of(&o).len());
    // The summary of an all-NaN output says so.
    let nan = Tensor::from_vec(&[64, 784], vec![f32::NAN; 64 * 784]).unwrap();
    nan.write_npy(&d.join("nan.npy")).unwrap();
    let x = format!("x={}", s(&d.join("nan.npy")));
    let o = graphrun(&["models/mlp.yaml", "--input", &x, "--random-inputs"]);
    let out = out_of(&o);
    assert!(out.contains("min NaN max NaN (all NaN)"), "{out}");
}

#[test]
fn a_library_may_save_over_the_file_it_loaded() {
    // The guard against replacing inputs is the command line's (one process, one run): a
    // program that loads a model and later saves it back to the same file may do so.
    let d = tmpdir("libsave");
    let p = d.join("m.yaml");
    std::fs::copy("models/mlp.yaml", &p).unwrap();
    let m = graphrun::Model::load(&p).unwrap();
    m.save(&p).unwrap();
    assert!(graphrun::Model::load(&p).is_ok());
}
