//! SPEC §9: every bad input ends in one clear error naming the place (file:line:col) or
//! the node, op, values and shapes involved — never a panic.

use graphrun::{Model, Session, SessionOptions, Tensor};
use std::collections::HashMap;

fn load_err(yaml: &str) -> String {
    match Model::from_str(yaml, ".") {
        Ok(_) => panic!("expected an error for:\n{yaml}"),
        Err(e) => e.to_string(),
    }
}

fn has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message lacks {p:?}:\n{msg}");
    }
}

const HEAD: &str = "graphrun: 1\nname: t\n";

#[test]
fn malformed_yaml_names_line_and_col() {
    let e = load_err("graphrun: 1\ninputs: [\n  {name: x, dtype: f32\nnodes: []\n");
    has(&e, &["<string>:", "malformed YAML"]);
    // The position is a real line:col, not 0:0.
    let pos = e
        .split(':')
        .nth(1)
        .unwrap()
        .trim()
        .parse::<usize>()
        .unwrap();
    assert!(pos >= 2, "{e}");
}

#[test]
fn tabs_and_bad_indentation_are_errors() {
    let e = load_err("graphrun: 1\nnodes:\n  - op: Relu\n   inputs: [x]\n");
    has(&e, &["<string>:"]);
}

#[test]
fn format_version_is_checked() {
    has(
        &load_err("graphrun: 2\noutputs: [x]\n"),
        &["<string>:1:11", "unsupported format version 2"],
    );
    has(
        &load_err("name: t\noutputs: [x]\n"),
        &["missing the field 'graphrun'"],
    );
}

#[test]
fn unknown_fields_are_named_with_their_place() {
    let e = load_err(&format!(
        "{HEAD}inputs:\n  - {{name: x, dtype: f32, shape: [2], colour: red}}\noutputs: [x]\n"
    ));
    has(&e, &["<string>:4:", "unknown field 'colour'", "an input"]);
    let e = load_err(&format!("{HEAD}outputs: [x]\nextra: 1\n"));
    has(&e, &["<string>:4:", "unknown field 'extra'"]);
    let e = load_err(&format!("{HEAD}inputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [y]\nnodes:\n  - {{op: Relu, inputs: [x], outputs: [y], atrs: {{}}}}\n"));
    has(&e, &["<string>:6:", "unknown field 'atrs'"]);
}

#[test]
fn duplicate_yaml_keys_are_errors() {
    let e = load_err(&format!("{HEAD}outputs: [x]\noutputs: [y]\n"));
    has(&e, &["<string>:4:1", "duplicate key 'outputs'"]);
}

#[test]
fn every_unknown_op_is_reported_at_once() {
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [z]\nnodes:\n  - {{op: Frobnicate, inputs: [x], outputs: [y]}}\n  - {{op: Relu, inputs: [y], outputs: [y2]}}\n  - {{op: Convolve, inputs: [y2], outputs: [z]}}\n"
    ));
    has(
        &e,
        &[
            "unknown op 'Frobnicate'",
            "unknown op 'Convolve'",
            "<string>:6:",
            "<string>:8:",
        ],
    );
}

#[test]
fn undefined_and_duplicate_values() {
    let e = load_err(&format!("{HEAD}inputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [y]\nnodes:\n  - {{op: Add, inputs: [x, w], outputs: [y], name: add1}}\n"));
    has(&e, &["node 'add1' (Add)", "input 'w' is not defined"]);
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [y]\nnodes:\n  - {{op: Relu, inputs: [x], outputs: [y]}}\n  - {{op: Neg, inputs: [x], outputs: [y], name: second}}\n"
    ));
    has(
        &e,
        &[
            "value 'y' is defined twice",
            "node 'Relu_0' (Relu)",
            "node 'second' (Neg)",
        ],
    );
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [nope]\nnodes: []\n"
    ));
    has(&e, &["graph output 'nope'"]);
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: w, dtype: f32, shape: [2]}}]\noutputs: [w]\ninitializers:\n  - {{name: w, dtype: f32, shape: [2], init: zeros}}\n"
    ));
    has(
        &e,
        &["value 'w' is defined twice", "graph input", "initializer"],
    );
}

#[test]
fn cycles_are_named() {
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [c]\nnodes:\n  - {{op: Add, inputs: [x, c], outputs: [a], name: na}}\n  - {{op: Relu, inputs: [a], outputs: [b], name: nb}}\n  - {{op: Neg, inputs: [b], outputs: [c], name: nc}}\n"
    ));
    has(&e, &["cycle", "'na'", "'nb'", "'nc'"]);
}

#[test]
fn wrong_attribute_types() {
    let base = |attrs: &str, op: &str| {
        format!("{HEAD}inputs: [{{name: x, dtype: f32, shape: [2, 3]}}]\noutputs: [y]\nnodes:\n  - {{op: {op}, inputs: [x], outputs: [y], name: n1, attrs: {attrs}}}\n")
    };
    has(
        &load_err(&base("{axis: last}", "Softmax")),
        &[
            "<string>:6:",
            "node 'n1' (Softmax)",
            "attribute 'axis' must be an integer, got a string",
        ],
    );
    has(
        &load_err(&base("{perm: 1.5}", "Transpose")),
        &["attribute 'perm' must be a list of integers"],
    );
    has(
        &load_err(&base("{perm: [0, 0]}", "Transpose")),
        &["not a permutation"],
    );
    has(
        &load_err(&base("{approximate: fast}", "Gelu")),
        &["attribute 'approximate'", "\"fast\""],
    );
    has(
        &load_err(&base("{to: f128}", "Cast")),
        &["attribute 'to'", "unsupported dtype"],
    );
    has(
        &load_err(&base("{bogus: 1}", "Relu")),
        &["unknown attribute 'bogus' for op Relu"],
    );
    has(
        &load_err(&base("{}", "Cast")),
        &["attribute 'to' is required"],
    );
    has(
        &load_err(&base("{is_causal: 2}", "Softmax")),
        &["unknown attribute 'is_causal'"],
    );
}

#[test]
fn unknown_ops_and_attributes_suggest_the_closest_name() {
    let node = |op: &str, attrs: &str| {
        load_err(&format!("{HEAD}inputs: [{{name: x, dtype: f32, shape: [2, 3]}}]\noutputs: [y]\nnodes:\n  - {{op: {op}, inputs: [x], outputs: [y], name: n1, attrs: {attrs}}}\n"))
    };
    has(
        &node("Sofmax", "{}"),
        &[
            "<string>:6:",
            "unknown op 'Sofmax'; did you mean 'Softmax'?",
        ],
    );
    has(&node("relu", "{}"), &["did you mean 'Relu'?"]);
    has(
        &node("LayerNormalisation", "{}"),
        &["did you mean 'LayerNormalization'?"],
    );
    // Nothing close: no guess.
    let e = node("Frobnicate", "{}");
    has(&e, &["unknown op 'Frobnicate'"]);
    assert!(!e.contains("did you mean"), "{e}");
    // An attribute: the closest valid one, and every valid one.
    has(
        &node("Softmax", "{axs: 1}"),
        &[
            "<string>:6:",
            "unknown attribute 'axs' for op Softmax; did you mean 'axis'? (Softmax takes: axis)",
        ],
    );
    let e = node("Gemm", "{transB: 1, alpah: 2.0}");
    has(
        &e,
        &[
            "unknown attribute 'alpah' for op Gemm; did you mean 'alpha'?",
            "transA",
            "beta",
        ],
    );
    let e = node("Relu", "{alpha: 0.1}");
    has(
        &e,
        &["unknown attribute 'alpha' for op Relu; (Relu takes no attributes)"],
    );
    let e = node("LeakyRelu", "{colour: 1}");
    has(&e, &["(LeakyRelu takes: alpha)"]);
    assert!(!e.contains("did you mean"), "{e}");
}

#[test]
fn incompatible_shapes_name_node_and_shapes() {
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: x, dtype: f32, shape: [4, 3]}}]\noutputs: [y]\ninitializers:\n  - {{name: w, dtype: f32, shape: [5, 2], init: ones}}\nnodes:\n  - {{op: MatMul, inputs: [x, w], outputs: [y], name: fc}}\n"
    ));
    has(
        &e,
        &[
            "node 'fc' (MatMul)",
            "cannot multiply [4, 3] by [5, 2]",
            "x: f32[4, 3]",
            "w: f32[5, 2]",
        ],
    );
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: x, dtype: f32, shape: [4, 3]}}, {{name: z, dtype: f32, shape: [5]}}]\noutputs: [y]\nnodes:\n  - {{op: Add, inputs: [x, z], outputs: [y], name: plus}}\n"
    ));
    has(
        &e,
        &["node 'plus' (Add)", "[4, 3] and [5] do not broadcast"],
    );
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: x, dtype: f32, shape: [4, 3]}}, {{name: i, dtype: i64, shape: [4, 3]}}]\noutputs: [y]\nnodes:\n  - {{op: Add, inputs: [x, i], outputs: [y], name: mixed}}\n"
    ));
    has(&e, &["node 'mixed' (Add)", "dtypes differ: f32 and i64"]);
}

#[test]
fn huge_dims_overflow_is_an_error() {
    let e = load_err(&format!(
        "{HEAD}inputs: [{{name: x, dtype: f32, shape: [4294967296, 4294967296, 16]}}]\noutputs: [y]\nnodes:\n  - {{op: Relu, inputs: [x], outputs: [y]}}\n"
    ));
    has(&e, &["'x'", "too large"]);
    let e = load_err(&format!(
        "{HEAD}outputs: [w]\ninitializers:\n  - {{name: w, dtype: f32, shape: [99999999999, 99999999999], init: zeros}}\n"
    ));
    has(&e, &["<string>:5:", "too large"]);
    let e = load_err(&format!(
        "{HEAD}dims: {{b: 99999999999999999999999}}\noutputs: [x]\n"
    ));
    has(&e, &["dims.b"]);
}

#[test]
fn initializer_files_missing_or_mismatched() {
    let dir = std::env::temp_dir().join(format!("graphrun_bad_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let t = Tensor::from_vec(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    t.write_npy(&dir.join("w.npy")).unwrap();
    let model =
        |extra: &str| format!("{HEAD}outputs: [w]\ninitializers:\n  - {{name: w, {extra}}}\n");
    let err = |extra: &str| {
        Model::from_str(&model(extra), &dir)
            .unwrap_err()
            .to_string()
    };
    has(&err("file: missing.npy"), &["missing.npy", "<string>:5:"]);
    has(&err("file: w.npy, dtype: f64"), &["holds f32", "dtype f64"]);
    has(
        &err("file: w.npy, shape: [3, 2]"),
        &["holds shape [2, 3]", "shape [3, 2]"],
    );
    std::fs::write(dir.join("junk.npy"), b"not an npy").unwrap();
    has(&err("file: junk.npy"), &["junk.npy", "not a valid .npy"]);
    std::fs::write(dir.join("junk.safetensors"), b"garbage").unwrap();
    has(
        &err("file: junk.safetensors"),
        &["junk.safetensors", "not a valid .safetensors"],
    );
    has(&err("file: w.txt"), &[".npy or .safetensors"]);
    // And the good case loads.
    let m = Model::from_str(&model("file: w.npy"), &dir).unwrap();
    assert_eq!(m.graph.initializers[0].tensor, t);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn initializer_spec_errors() {
    let m = |spec: &str| {
        load_err(&format!(
            "{HEAD}outputs: [w]\ninitializers:\n  - {{name: w, {spec}}}\n"
        ))
    };
    has(
        &m("dtype: f32, shape: [2], values: [1, 2, 3]"),
        &["shape [2] (2 values) but 3 values"],
    );
    has(
        &m("dtype: f32, shape: [2], init: zeros, values: [1, 2]"),
        &["exactly one of init, values, file"],
    );
    has(
        &m("dtype: f32, shape: [2], init: {dist: gaussian, seed: 1}"),
        &["unknown dist 'gaussian'"],
    );
    has(
        &m("dtype: f32, shape: [2], init: {dist: normal}"),
        &["missing the field 'seed'"],
    );
    has(
        &m("dtype: i64, shape: [2], init: {dist: normal, seed: 1}"),
        &["random init needs a floating dtype"],
    );
    has(
        &m("dtype: f33, shape: [2], init: zeros"),
        &["unknown dtype 'f33'"],
    );
    has(
        &m("dtype: f32, shape: [-1], init: zeros"),
        &["non-negative"],
    );
    has(
        &m("dtype: f32, shape: [2], init: {dist: normal, seed: 1, low: 0}"),
        &["'low' does not apply to dist 'normal'"],
    );
}

fn run_feeds(yaml: &str, feeds: Vec<(&str, Tensor)>) -> String {
    let m = Model::from_str(yaml, ".").unwrap();
    let feeds: HashMap<String, Tensor> =
        feeds.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let mut s = Session::new(m.graph, SessionOptions::unfused()).unwrap();
    s.run(&feeds).unwrap_err().to_string()
}

#[test]
fn missing_extra_and_mistyped_inputs() {
    let y = format!("{HEAD}inputs:\n  - {{name: x, dtype: f32, shape: [b, 3]}}\n  - {{name: z, dtype: f32, shape: [b, 3]}}\noutputs: [y]\nnodes:\n  - {{op: Add, inputs: [x, z], outputs: [y]}}\n");
    let t = |r: usize| Tensor::from_vec(&[r, 3], vec![1.0f32; r * 3]).unwrap();
    has(
        &run_feeds(&y, vec![("x", t(2))]),
        &["missing graph input 'z'"],
    );
    has(
        &run_feeds(&y, vec![("x", t(2)), ("z", t(2)), ("q", t(2))]),
        &["'q' is not an input of the graph"],
    );
    has(
        &run_feeds(&y, vec![("x", t(2)), ("z", t(3))]),
        &["symbolic dim 'b' is bound to", "input 'x'", "input 'z'"],
    );
    let ti = Tensor::from_vec(&[2, 3], vec![1i64; 6]).unwrap();
    has(
        &run_feeds(&y, vec![("x", t(2)), ("z", ti)]),
        &["input 'z' must be f32, got i64"],
    );
    let t1 = Tensor::from_vec(&[6], vec![1.0f32; 6]).unwrap();
    has(
        &run_feeds(&y, vec![("x", t(2)), ("z", t1)]),
        &["input 'z' must have rank 2"],
    );
}

#[test]
fn wrong_arity_is_an_error() {
    let e = load_err(&format!("{HEAD}inputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [y]\nnodes:\n  - {{op: Add, inputs: [x], outputs: [y], name: a}}\n"));
    has(&e, &["node 'a' (Add)", "takes 2 inputs, got 1"]);
    let e = load_err(&format!("{HEAD}inputs: [{{name: x, dtype: f32, shape: [2]}}]\noutputs: [y]\nnodes:\n  - {{op: Relu, inputs: [x], outputs: [y, z], name: r}}\n"));
    has(&e, &["node 'r' (Relu)", "outputs"]);
}

#[test]
fn out_of_memory_is_an_error_not_an_abort() {
    // 2^61 bytes: no machine has it; the allocation must fail as a value.
    let e = Tensor::try_alloc(1usize << 61).unwrap_err().to_string();
    has(&e, &["memory limit"]);
    let y = format!("{HEAD}inputs: [{{name: x, dtype: f32, shape: [b, 1024]}}]\noutputs: [y]\nnodes:\n  - {{op: Relu, inputs: [x], outputs: [y]}}\n");
    let m = Model::from_str(&y, ".").unwrap();
    let dims = [("b".to_string(), 1usize << 48)].into_iter().collect();
    let e = m.random_inputs(0, &dims).unwrap_err().to_string();
    has(&e, &["memory limit"]);
    // A shape whose size does not overflow but that no machine here holds (160 GB):
    // refused before allocating, with the initializer's place, not killed while filling.
    let e = load_err(&format!(
        "{HEAD}outputs: [w]\ninitializers:\n  - {{name: w, dtype: f32, shape: [200000, 200000], init: {{dist: normal, seed: 1}}}}\n"
    ));
    has(
        &e,
        &["<string>:5:", "'w'", "[200000, 200000]", "memory limit"],
    );
}

#[test]
fn hostile_yaml_is_bounded() {
    // Deep nesting: an error, not a stack overflow.
    let deep = format!(
        "graphrun: 1\noutputs: {}{}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    has(&load_err(&deep), &["<string>:"]);
    // An alias bomb: an error, not exponential memory.
    let mut y = String::from("graphrun: 1\na0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..12 {
        let prev = format!("*a{}", i - 1);
        y.push_str(&format!("a{i}: &a{i} [{}]\n", vec![prev; 10].join(", ")));
    }
    has(&load_err(&y), &["too many nodes"]);
    // Binary garbage.
    let e = Model::from_str("\u{0}\u{1}\u{2}graphrun: [}{", ".")
        .unwrap_err()
        .to_string();
    assert!(!e.is_empty());
}

#[test]
fn npy_with_deeply_nested_header_is_refused_quickly() {
    // A fuzzing finding: npyz's header parser took >25 s on nested braces.
    let mut header = b"{'descr': ".to_vec();
    header.extend(std::iter::repeat_n(b'{', 80));
    header.extend_from_slice(b"'f4', 'fortran_order': False, 'shape': (10, ), }");
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(&header);
    let t0 = std::time::Instant::now();
    let e = Tensor::from_npy_bytes(&bytes).unwrap_err();
    has(&e, &["only plain arrays"]);
    assert!(t0.elapsed().as_secs() < 5);
    // The replayed artifact itself.
    let e = Tensor::from_npy_bytes(include_bytes!("data/fuzz_npy_nested_header.npy")).unwrap_err();
    has(&e, &["npy"]);
}

/// Found by the `onnx` fuzz target (docs/RELIABILITY.md): a mutated file whose shape
/// inference constant-folded an elementwise op on an empty (0-sized) tensor. The CPU
/// kernels' broadcast walk took `index % dim` with the zero dim and panicked. Replays the
/// fuzzer's file, which is now one clear error about the node's shapes.
#[test]
fn fuzz_onnx_empty_operand_is_an_error_not_a_panic() {
    let bytes = include_bytes!("data/fuzz_onnx_empty_broadcast.onnx");
    let e = graphrun::onnx::from_bytes(bytes, "fuzz", std::path::Path::new("/nonexistent"))
        .unwrap_err()
        .to_string();
    has(&e, &["'/Mul'", "do not broadcast", "[0]"]);
}

/// The same panic reached without ONNX: elementwise ops whose operands or result are
/// empty, folded at load time (initializers only) and run in a session (a fed input).
/// Results are empty with the broadcast shape; a gradient reaching a non-empty weight
/// through them is a sum over nothing, exactly zero.
#[test]
fn elementwise_ops_on_empty_tensors_load_run_and_differentiate() {
    let dims = |s: &str| -> Vec<usize> {
        let s = s.trim_matches(['[', ']']);
        s.split(", ").map(|d| d.parse().unwrap()).collect()
    };
    for (a, b, out) in [
        ("[0, 3]", "[1, 3]", "[0, 3]"),
        ("[0, 3]", "[3]", "[0, 3]"),
        ("[2, 0]", "[2, 1]", "[2, 0]"),
        ("[0]", "[0]", "[0]"),
    ] {
        let y = format!(
            "{HEAD}inputs: [{{name: x, dtype: f32, shape: {a}}}]\noutputs: [y, z]\n\
             initializers:\n  - {{name: w, dtype: f32, shape: {b}, init: {{dist: normal, seed: 3}}}}\n\
             \x20 - {{name: v, dtype: f32, shape: {a}, init: {{dist: normal, seed: 4}}, trainable: false}}\n\
             nodes:\n  - {{op: Mul, inputs: [v, w], outputs: [vw]}}\n\
             \x20 - {{op: Sigmoid, inputs: [vw], outputs: [z]}}\n\
             \x20 - {{op: Add, inputs: [x, w], outputs: [xw]}}\n\
             \x20 - {{op: Div, inputs: [xw, w], outputs: [q]}}\n\
             \x20 - {{op: Relu, inputs: [q], outputs: [y]}}\n"
        );
        let m = Model::from_str(&y, ".").unwrap_or_else(|e| panic!("{a} {b}: {e}"));
        let x = Tensor::from_vec(&dims(a), Vec::<f32>::new()).unwrap();
        let feeds: HashMap<String, Tensor> = [("x".to_string(), x)].into();
        let mut s = Session::new(m.graph, SessionOptions::unfused()).unwrap();
        let r = s
            .backward(&feeds, &HashMap::new())
            .unwrap_or_else(|e| panic!("{a} {b}: {e}"));
        for (name, t) in &r.outputs {
            assert_eq!(t.shape(), dims(out), "{a} {b}: output {name}");
        }
        let (_, gw) = r
            .grads
            .iter()
            .find(|(n, _)| n == "w")
            .expect("a gradient for w");
        assert_eq!(gw.shape(), dims(b), "{a} {b}");
        let gw = gw.to_f64_vec();
        assert!(gw.iter().all(|&v| v == 0.0), "{a} {b}: {gw:?}");
    }
}

/// The shipped models with every symbolic dim bound to 0 (an empty batch): forward and
/// backward runs give empty outputs (and scalar losses) instead of panicking in the kernels.
#[test]
fn models_run_forward_and_backward_on_an_empty_batch() {
    for name in ["mlp", "attention", "gpt_block"] {
        let m = Model::load(format!("{}/models/{name}.yaml", env!("CARGO_MANIFEST_DIR"))).unwrap();
        let dims: std::collections::BTreeMap<String, usize> =
            m.graph.symbols().into_iter().map(|s| (s, 0)).collect();
        let feeds = m.random_inputs(0, &dims).unwrap();
        let opts = SessionOptions {
            dims,
            ..SessionOptions::unfused()
        };
        let mut s = Session::new(m.graph, opts).unwrap();
        let r = s
            .backward(&feeds, &HashMap::new())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // Every output but the scalar losses has the batch dim.
        for (out, t) in &r.outputs {
            let empty = t.numel() == 0 || (out == "loss" && t.shape().is_empty());
            assert!(empty, "{name}: output {out} of shape {:?}", t.shape());
        }
    }
}
