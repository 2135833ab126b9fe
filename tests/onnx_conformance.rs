//! ONNX's own backend node tests (tests/onnx_node/, vendored from the onnx wheel by
//! scripts/vendor_onnx_node_tests.py) on every available backend, with SPEC §8's
//! tolerances. docs/CONFORMANCE.md is generated from the results of the backends CI runs;
//! this test fails when it is stale. Regenerate with
//! `UPDATE_CONFORMANCE=1 cargo test --test onnx_conformance`.
//!
//! A case either passes or is listed in `OUT_OF_SCOPE` with the reason; an unlisted
//! failure fails the test, and so does a listed case that passes.

mod common;

use graphrun::onnx::proto::{ModelProto, TensorProto};
use graphrun::onnx::tensor::from_proto;
use graphrun::passes::{self, PassOptions};
use graphrun::{BackendKind, DType, Model, Session, SessionOptions, Tensor};
use prost::Message;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const CASES: &str = "tests/onnx_node";
const DOC: &str = "docs/CONFORMANCE.md";

const NOT_A_DTYPE: &str =
    "Not one of graphrun's dtypes (SPEC §1: f32, f16, bf16, f64, i64, i32, bool)";

/// Cases graphrun does not run, by case name ('*' matches any run of characters), and why.
const OUT_OF_SCOPE: &[(&str, &str)] = &[
    ("test_*_uint8", NOT_A_DTYPE),
    ("test_clip_default_int8_*", NOT_A_DTYPE),
    ("test_pow_types_float32_uint*", NOT_A_DTYPE),
    ("test_cast*FLOAT8*", NOT_A_DTYPE),
    ("test_cast*INT4*", NOT_A_DTYPE),
    ("test_cast*STRING*", NOT_A_DTYPE),
    ("test_equal_string*", NOT_A_DTYPE),
    (
        "test_identity_opt",
        "Optional values: graphrun's values are dense tensors",
    ),
    (
        "test_identity_sequence",
        "Sequences: graphrun's values are dense tensors",
    ),
    (
        "test_reduce_max_bool_inputs",
        "ReduceMax over bool (opset 20): graphrun's reductions take numbers",
    ),
    ("test_training_dropout", RANDOM_MASK),
    ("test_training_dropout_mask", RANDOM_MASK),
    ("test_training_dropout_default*", RANDOM_MASK),
];

const RANDOM_MASK: &str = "Training-mode Dropout draws a random mask, and graphrun's seeded \
    generator is not numpy's, so the kept elements differ by design (the ratio-0 and \
    inference cases pass)";

/// The backends whose results the doc records: those CI runs (wgpu on lavapipe). Others
/// (CUDA, where there is a GPU) must give the CPU's outcomes; the test checks that, the doc
/// does not show it.
const DOC_BACKENDS: &[BackendKind] = &[BackendKind::Cpu, BackendKind::Wgpu];

const WGSL_NO_DTYPE: &str = "wgpu: WGSL has no f64 or bf16 type, and this case computes in one \
    (the backend refuses the node with an error naming node, op and dtype: SPEC §7)";
const WGSL_NO_INT_POW: &str = "wgpu: WGSL has no 64-bit integers and graphrun's WGSL runs only \
    i32 Add, Sub, Mul, Div, comparisons and Clip (the node is refused with a clear error)";

/// Cases one backend cannot run (on top of `OUT_OF_SCOPE`), and why.
const BACKEND_OUT_OF_SCOPE: &[(BackendKind, &str, &str)] = &[
    (BackendKind::Wgpu, "test_cast*DOUBLE*", WGSL_NO_DTYPE),
    (BackendKind::Wgpu, "test_cast*BFLOAT16*", WGSL_NO_DTYPE),
    (BackendKind::Wgpu, "test_pow_types_int*", WGSL_NO_INT_POW),
];

struct Case {
    name: String,
    /// The op of the case's one node.
    op: String,
    dir: PathBuf,
}

fn cases() -> Vec<Case> {
    let mut out = vec![];
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(CASES)
        .expect("tests/onnx_node exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.onnx").exists())
        .collect();
    dirs.sort();
    for dir in dirs {
        let bytes = std::fs::read(dir.join("model.onnx")).unwrap();
        let m = ModelProto::decode(bytes.as_slice()).unwrap();
        let op = m.graph.as_ref().unwrap().node[0].op_type.clone();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        out.push(Case { name, op, dir });
    }
    out
}

fn out_of_scope(case: &str, backend: BackendKind) -> Option<&'static str> {
    OUT_OF_SCOPE
        .iter()
        .find_map(|(pat, why)| glob(pat, case).then_some(*why))
        .or_else(|| {
            BACKEND_OUT_OF_SCOPE
                .iter()
                .find_map(|(b, pat, why)| (*b == backend && glob(pat, case)).then_some(*why))
        })
}

/// Whether `s` matches `pat`, where '*' stands for any run of characters.
fn glob(pat: &str, s: &str) -> bool {
    let parts: Vec<&str> = pat.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return s == pat;
    }
    if !s.starts_with(first) || !s[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &s[first.len()..s.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// Reads `<set>/<prefix>_<i>.pb` for i = 0, 1, ...
fn read_pbs(set: &Path, prefix: &str) -> Result<Vec<Tensor>, String> {
    (0..)
        .map(|i| set.join(format!("{prefix}_{i}.pb")))
        .take_while(|p| p.exists())
        .map(|p| read_pb(&p))
        .collect()
}

/// One TensorProto file. numpy has no bfloat16, so ONNX's test data stores bfloat16
/// values as UINT16 bit patterns; they are read back as the bfloat16 they are.
fn read_pb_proto(p: &Path) -> Result<TensorProto, String> {
    const UINT16: i32 = 4;
    const BFLOAT16: i32 = 16;
    let bytes = std::fs::read(p).map_err(|e| e.to_string())?;
    let mut t = TensorProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    if t.data_type == UINT16 {
        t.data_type = BFLOAT16;
    }
    Ok(t)
}

fn read_pb(p: &Path) -> Result<Tensor, String> {
    let t = read_pb_proto(p)?;
    from_proto(&t, Path::new("."), &format!("{}", p.display())).map_err(|e| e.to_string())
}

/// The inputs graphrun needs when it plans (they decide shapes; infer.rs reads them as
/// constants), by op. ONNX's tests feed them as graph inputs.
fn plan_time_inputs(op: &str) -> &'static [usize] {
    match op {
        "Reshape" | "Expand" | "Split" | "Squeeze" | "Unsqueeze" => &[1],
        "ReduceSum" | "ReduceMean" | "ReduceMax" => &[1],
        "Slice" => &[1, 2, 3, 4],
        _ => &[],
    }
}

/// The case's model for one data set, and the feeds. graphrun plans shapes before it runs
/// (SPEC §5, §9), so the graph inputs that decide a shape (a Reshape's shape, a
/// ReduceSum's axes) become initializers holding the data set's values; the importer
/// takes a graph input that has an initializer as that initializer.
fn model_for(c: &Case, set: &Path) -> Result<(Model, HashMap<String, Tensor>), String> {
    let bytes = std::fs::read(c.dir.join("model.onnx")).map_err(|e| e.to_string())?;
    let mut m = ModelProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    let g = m.graph.as_mut().ok_or("no graph")?;
    let planned: Vec<String> = g
        .node
        .iter()
        .flat_map(|n| {
            plan_time_inputs(&n.op_type)
                .iter()
                .filter_map(|&i| n.input.get(i).filter(|v| !v.is_empty()).cloned())
        })
        .collect();
    // input_<i>.pb feeds the i-th graph input.
    let inputs: Vec<(String, PathBuf)> = g
        .input
        .iter()
        .enumerate()
        .map(|(i, vi)| (vi.name.clone(), set.join(format!("input_{i}.pb"))))
        .filter(|(_, pb)| pb.exists())
        .collect();
    for (name, pb) in inputs.iter().filter(|(n, _)| planned.contains(n)) {
        let mut t = read_pb_proto(pb)?;
        t.name = name.clone();
        g.initializer.push(t);
    }
    let graph = graphrun::onnx::from_bytes(&m.encode_to_vec(), &c.name, &c.dir)
        .map_err(|e| e.to_string())?;
    let mut feeds = HashMap::new();
    for (name, pb) in inputs.iter().filter(|(n, _)| !planned.contains(n)) {
        feeds.insert(name.clone(), read_pb(pb)?);
    }
    Ok((Model { graph }, feeds))
}

/// Runs one case on one backend: Ok, or why not.
fn run_case(c: &Case, backend: BackendKind) -> Result<(), String> {
    let mut sets: Vec<PathBuf> = std::fs::read_dir(&c.dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    sets.sort();
    for set in sets {
        let (model, feeds) = model_for(c, &set)?;
        let want = read_pbs(&set, "output")?;
        let (fused, _) =
            passes::optimize(&model.graph, &PassOptions::default()).map_err(|e| e.to_string())?;
        let opts = SessionOptions {
            backend,
            ..Default::default()
        };
        let mut session = Session::new(fused, opts).map_err(|e| e.to_string())?;
        let got = session.run(&feeds).map_err(|e| e.to_string())?;
        for ((name, t), w) in got.iter().zip(&want) {
            compare(t, w).map_err(|e| format!("output '{name}': {e}"))?;
        }
    }
    Ok(())
}

/// Floating outputs within SPEC §8's tolerance of their dtype, the others exactly.
fn compare(got: &Tensor, want: &Tensor) -> Result<(), String> {
    if got.dtype() != want.dtype() || got.shape() != want.shape() {
        return Err(format!(
            "got {}{:?}, expected {}{:?}",
            got.dtype(),
            got.shape(),
            want.dtype(),
            want.shape()
        ));
    }
    if !want.dtype().is_float() {
        return match got.bytes() == want.bytes() {
            true => Ok(()),
            false => Err("values differ (exact comparison)".into()),
        };
    }
    let tol = match want.dtype() {
        DType::F64 => 1e-10,
        DType::F32 => 1e-5,
        _ => 1e-2,
    };
    let e = common::rel_err(&got.to_f64_vec(), &want.to_f64_vec());
    if e <= tol {
        Ok(())
    } else {
        Err(format!("relative error {e:.2e} > {tol:.0e}"))
    }
}

/// The first line of an error, without the case's path.
fn short(e: &str, dir: &Path) -> String {
    let first = e.lines().next().unwrap_or("");
    let path = format!("{}: ", dir.join("model.onnx").display());
    first.replace(&path, "")
}

fn doc(cases: &[Case], results: &BTreeMap<(String, String), Result<(), String>>) -> String {
    let names: Vec<&str> = DOC_BACKENDS.iter().map(|b| b.name()).collect();
    let kind = |b: &str| BackendKind::parse(b).expect("a backend name");
    let mut per_op: BTreeMap<&str, Vec<&Case>> = BTreeMap::new();
    for c in cases {
        per_op.entry(&c.op).or_default().push(c);
    }
    let result = |c: &Case, b: &str| &results[&(c.name.clone(), b.to_string())];
    let mut s = String::from(
        "# ONNX conformance\n\n\
         Generated by `tests/onnx_conformance.rs` (`UPDATE_CONFORMANCE=1 cargo test --test onnx_conformance`); \
         CI fails when this file is stale.\n\n\
         The cases are ONNX's own backend node tests for the operators graphrun implements (SPEC §2), \
         vendored from the onnx wheel into `tests/onnx_node/` by `scripts/vendor_onnx_node_tests.py`. \
         Each case's `model.onnx` is imported, optimized by the default passes and run on its inputs; \
         every output is compared with ONNX's expected output: floating outputs within SPEC §8's \
         relative error (‖out − ref‖/‖ref‖ ≤ 1e-5 for f32, 1e-2 for f16/bf16, 1e-10 for f64), \
         integer and bool outputs exactly. Inputs that decide a shape (a Reshape's shape, Slice's \
         starts, a reduction's axes), which the tests feed at run time, are given to graphrun as \
         initializers holding the same values: graphrun plans shapes before it runs. \
         Other backends, where present (CUDA), must give the same outcomes.\n\n",
    );
    for b in &names {
        let n = cases.iter().filter(|c| result(c, b).is_ok()).count();
        let out = cases
            .iter()
            .filter(|c| out_of_scope(&c.name, kind(b)).is_some())
            .count();
        s += &format!(
            "**{b}: {n} of {} cases pass; the other {} are out of scope, each for the reason below.**\n",
            cases.len(),
            out
        );
    }
    s += &format!(
        "\n| op | {} | out of scope ({}) |\n|---|{}---|\n",
        names.join(" | "),
        names.join(" / "),
        "---|".repeat(names.len())
    );
    for (op, cs) in &per_op {
        let cols: Vec<String> = names
            .iter()
            .map(|b| {
                let n = cs.iter().filter(|c| result(c, b).is_ok()).count();
                format!("{n}/{}", cs.len())
            })
            .collect();
        let out: Vec<String> = names
            .iter()
            .map(|b| {
                cs.iter()
                    .filter(|c| out_of_scope(&c.name, kind(b)).is_some())
                    .count()
                    .to_string()
            })
            .collect();
        s += &format!("| `{op}` | {} | {} |\n", cols.join(" | "), out.join(" / "));
    }
    let missing: Vec<String> = graphrun::graph::op::OP_NAMES
        .iter()
        .filter(|op| !per_op.contains_key(*op) && !["FusedMatMul", "VarlenAttention"].contains(op))
        .map(|op| format!("`{op}`"))
        .collect();
    if !missing.is_empty() {
        s += &format!(
            "\nOps with no node test in this onnx release: {}.\n",
            missing.join(", ")
        );
    }
    s += "\n## Out of scope\n\nCases that fail by design, grouped by reason, with what graphrun says.\n";
    let mut by_reason: BTreeMap<&str, Vec<&Case>> = BTreeMap::new();
    for c in cases {
        let mut whys: Vec<&str> = names
            .iter()
            .filter_map(|b| out_of_scope(&c.name, kind(b)))
            .collect();
        whys.dedup();
        for why in whys {
            by_reason.entry(why).or_default().push(c);
        }
    }
    for (why, cs) in &by_reason {
        let n = cs.len();
        s += &format!(
            "\n**{why}** ({n} case{})\n\n",
            if n == 1 { "" } else { "s" }
        );
        for c in cs {
            let said = names
                .iter()
                .filter(|b| out_of_scope(&c.name, kind(b)) == Some(*why))
                .find_map(|b| result(c, b).as_ref().err())
                .map(|e| short(e, &c.dir))
                .unwrap_or_default();
            s += &format!("- `{}` ({}): {said}\n", c.name, c.op);
        }
    }
    let dropped = std::fs::read_to_string(Path::new(CASES).join("DROPPED")).unwrap_or_default();
    if !dropped.trim().is_empty() {
        s += "\n## Not vendored\n\nCases of supported ops left out of `tests/onnx_node/` for their size \
              (smaller cases of the same op and attributes are kept).\n\n";
        for line in dropped.lines() {
            if let [case, op, why] = line.split('\t').collect::<Vec<_>>()[..] {
                s += &format!("- `{case}` ({op}): {why}\n");
            }
        }
    }
    let source = std::fs::read_to_string(Path::new(CASES).join("SOURCE")).unwrap_or_default();
    s += &format!("\nSource: {}\n", source.trim());
    s
}

#[test]
fn onnx_node_tests() {
    let cases = cases();
    assert!(
        cases.len() > 300,
        "tests/onnx_node holds {} cases",
        cases.len()
    );
    let mut results = BTreeMap::new();
    let mut problems = vec![];
    for backend in common::backends() {
        for c in &cases {
            let r = run_case(c, backend);
            match (&r, out_of_scope(&c.name, backend)) {
                (Err(e), None) => problems.push(format!("{} on {}: {e}", c.name, backend.name())),
                (Ok(()), Some(_)) => problems.push(format!(
                    "{} on {} passes but is listed in OUT_OF_SCOPE",
                    c.name,
                    backend.name()
                )),
                _ => {}
            }
            results.insert((c.name.clone(), backend.name().to_string()), r);
        }
    }
    let ran = common::backends();
    let text = match DOC_BACKENDS.iter().find(|b| !ran.contains(b)) {
        // Without that backend here (no Vulkan), the doc cannot be checked; CI has it.
        Some(b) => {
            eprintln!(
                "not checking {DOC}: backend {} is not available here",
                b.name()
            );
            None
        }
        None => Some(doc(&cases, &results)),
    };
    if let Some(text) = text {
        check_doc(&text, &mut problems);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Writes the doc (UPDATE_CONFORMANCE) or records a problem when it is stale.
fn check_doc(text: &str, problems: &mut Vec<String>) {
    if std::env::var_os("UPDATE_CONFORMANCE").is_some() {
        std::fs::write(DOC, text).unwrap();
    } else {
        let current = std::fs::read_to_string(DOC).unwrap_or_default();
        if current != text {
            problems.push(format!(
                "{DOC} is stale: run UPDATE_CONFORMANCE=1 cargo test --test onnx_conformance"
            ));
        }
    }
}
