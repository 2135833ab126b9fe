//! ONNX's backend node tests, the whole suite as the `onnx` 1.22.0 Python package ships it
//! (`onnx/backend/test/data/node/`, 1,765 cases), on every available backend.
//!
//! Each case's model is imported as it is and every graph input is fed from the case's
//! data sets as the suite gives it. A case passes when every output matches; otherwise it
//! gets a reason (a category and graphrun's first error line). docs/CONFORMANCE.md is
//! generated from the outcomes on the backends CI runs (cpu and wgpu). The test fails when
//! a case the doc lists as passing fails (a regression), when the doc is stale (regenerate
//! with `UPDATE_CONFORMANCE=1 cargo test --test onnx_conformance`), when a case in `KNOWN`
//! passes, and where CUDA (when present) has another outcome than the CPU unless
//! `CUDA_DIFFERS` lists the case. A case that fails for another reason does not fail the
//! test: the doc lists it, and that list is the work queue.
//!
//! The suite is found through `GRAPHRUN_ONNX_NODE_TESTS` (the `node` folder, which must
//! hold the 1,765 cases) or else the `onnx` package of `python3` (which must be 1.22.0).
//! Without it the test is skipped with a printed reason, unless `CI` is set (CI installs
//! onnx 1.22.0: `.ci/run`).

mod common;

use graphrun::onnx::proto::{ModelProto, TensorProto, ValueInfoProto};
use graphrun::onnx::tensor::{from_proto, onnx_dtype_name};
use graphrun::onnx::ImportOptions;
use graphrun::passes::{self, PassOptions};
use graphrun::{BackendKind, DType, Session, SessionOptions, Tensor};
use prost::Message;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

const DOC: &str = "docs/CONFORMANCE.md";
/// The onnx release whose suite the doc's counts describe.
const ONNX_VERSION: &str = "1.22.0";
const SUITE_CASES: usize = 1765;
const SUITE_ENV: &str = "GRAPHRUN_ONNX_NODE_TESTS";

/// Cases whose ops graphrun implements but which do not pass by design, by case name
/// ('*' matches any run of characters), and why. A listed case that passes fails the test
/// (the entry is stale).
const KNOWN: &[(&str, &str)] = &[
    ("test_training_dropout", RANDOM_MASK),
    ("test_training_dropout_mask", RANDOM_MASK),
    ("test_training_dropout_default", RANDOM_MASK),
    ("test_training_dropout_default_mask", RANDOM_MASK),
    ("test_bernoulli*", RANDOM_BITS),
    ("test_gridsample_bicubic", F32_EXPECTED),
    ("test_roialign_aligned_*", FOUR_DECIMALS),
    (
        "test_averagepool_2d_ceil_last_window_starts_on_pad",
        FOUR_DECIMALS_POOL,
    ),
    (
        "test_optional_has_element_empty_optional_input",
        EMPTY_OPTIONAL,
    ),
];

const EMPTY_OPTIONAL: &str = "graphrun plans a model with every graph input present: a graph \
    input of an optional type is its tensor, which must be fed, so feeding it empty is \
    refused as a missing input";

const FOUR_DECIMALS: &str = "ONNX's expected output is written to four decimals; ONNX's own \
    reference evaluator is 6e-5 (relative) from it, as graphrun is";

const FOUR_DECIMALS_POOL: &str = "ONNX's expected output is written to four decimals; ONNX's \
    own reference evaluator gives graphrun's output to the last bit, 1.6e-4 (relative) from it";

const F32_EXPECTED: &str = "ONNX's expected output, computed in float32, is itself 1.5e-5 \
    (relative) from the float64 result; graphrun's float32 output is 7e-9 from it";

const RANDOM_MASK: &str = "training-mode Dropout draws a random mask, and graphrun's seeded \
    generator is not numpy's, so the kept elements differ (the ratio-0 and inference cases \
    pass)";

const RANDOM_BITS: &str = "Bernoulli draws at random, and graphrun's seeded generator is not \
    numpy's, so which elements are 1 differs (the output's type and shape match)";

/// Cases where CUDA's outcome may differ from the CPU's, and why. Checked only where a
/// CUDA device is present; a listed case whose outcomes agree fails the test.
const CUDA_DIFFERS: &[(&str, &str)] = &[];

/// What the CUDA and WebGPU backends say of the narrow storage types.
const CPU_ONLY: &str = "storage types, which Cast converts";

/// The backends whose outcomes the doc records: those CI runs (wgpu on lavapipe).
const DOC_BACKENDS: &[BackendKind] = &[BackendKind::Cpu, BackendKind::Wgpu];

/// Why a case does not pass. A case falls in the first category of `ALL` that applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    NotTensor,
    Dtype,
    Unsupported,
    Opset,
    RunTimeShapes,
    Numerical,
    BackendDtype,
    Known,
    Other,
}

impl Category {
    /// In the order a case is assigned its category (and the doc lists them): what the
    /// model needs that graphrun lacks (seen in the model, it blocks everything after),
    /// the known exceptions, then what graphrun said while importing, planning, running
    /// and comparing.
    const ALL: [Category; 9] = [
        Category::NotTensor,
        Category::Dtype,
        Category::Unsupported,
        Category::Known,
        Category::Opset,
        Category::RunTimeShapes,
        Category::BackendDtype,
        Category::Numerical,
        Category::Other,
    ];

    fn title(self) -> &'static str {
        match self {
            Category::NotTensor => "Not a tensor model",
            Category::Dtype => "Element types graphrun lacks",
            Category::Unsupported => "Unsupported operators",
            Category::Opset => "Opsets graphrun does not import",
            Category::RunTimeShapes => "Shapes or loops decided by run-time inputs",
            Category::Numerical => "Numerical mismatch",
            Category::BackendDtype => "Element types a backend lacks",
            Category::Known => "Not passing by design",
            Category::Other => "Other errors",
        }
    }

    fn blurb(self) -> String {
        let text = match self {
            Category::NotTensor => {
                "graphrun writes a sequence out as the list of its tensors when it loads a \
                 model (a sequence graph input as its elements, each an input of its own), \
                 and If, Loop and Scan bodies once per branch, iteration or step; sequences \
                 go through an If and through a Loop whose iterations are known then. What \
                 has no such form: a sequence input fed with no elements, a sequence through \
                 a Scan or a Loop that may stop early, an If whose condition is fed choosing \
                 between an empty optional and a value."
            }
            Category::Dtype => {
                let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
                return format!(
                    "An input or output has an element type graphrun does not have (it has {}).",
                    names.join(", ")
                );
            }
            Category::Unsupported => {
                "The model uses operators graphrun does not implement; one line per set of \
                 missing operators."
            }
            Category::Opset => {
                return format!(
                    "The model imports an ai.onnx opset outside the range the importer takes \
                     ({} to {}).",
                    graphrun::onnx::OLDEST_OPSET,
                    graphrun::onnx::MAX_OPSET
                );
            }
            Category::RunTimeShapes => {
                "An input that decides a shape (a Reshape's shape, Slice's starts, a \
                 reduction's axes, ...) is fed at run time, and graphrun needs it when it \
                 plans; or a Loop's trip count is, and graphrun writes a loop out when it \
                 loads the model."
            }
            Category::Numerical => {
                "graphrun runs the case but an output differs from ONNX's expected output \
                 beyond the tolerance above. Where the output is also within ONNX's own \
                 runner's tolerance (elementwise, rtol 1e-3 and atol 1e-7), the line says so."
            }
            Category::BackendDtype => {
                "The backend refuses the node for its element type (WGSL has no f64 or bf16 and \
                 no 64-bit integers, which the WebGPU backend runs as word pairs in the \
                 elementwise binary maps, TopK and casts only; f16 needs the adapter's \
                 SHADER_F16)."
            }
            Category::Known => "graphrun runs every op of these cases; they differ by design.",
            Category::Other => "Any other error, as graphrun gives it.",
        };
        text.to_string()
    }

    /// Whether the doc lists this category's cases grouped by their reason rather than
    /// one line per case (the reason says all there is to say).
    fn grouped(self) -> bool {
        matches!(
            self,
            Category::Unsupported | Category::Opset | Category::Dtype | Category::NotTensor
        )
    }
}

/// Why one case did not pass on one backend.
#[derive(Clone, Debug, PartialEq)]
struct Fail {
    cat: Category,
    /// What the doc groups by (the missing ops, the element types, the opset, ...), or
    /// the reason for one case.
    reason: String,
}

type Outcome = Result<(), Fail>;

/// What the model says about itself, read before running it.
struct Case {
    name: String,
    /// The operator the case tests: its one node's op, or for an `_expanded` case (the
    /// op's function body of simpler ops) the op of the case it expands.
    op: String,
    dir: PathBuf,
    /// The ops of its graph ("domain::Op" outside ai.onnx).
    ops: BTreeSet<String>,
    /// The ai.onnx opset it imports.
    opset: i64,
    /// Why the case cannot run, from the model alone.
    blocked: Option<Fail>,
}

/// The part of a ModelProto graphrun's importer does not read but the test needs to tell
/// why a case cannot run: local functions.
#[derive(Clone, PartialEq, Message)]
struct ModelExtras {
    #[prost(bytes = "vec", repeated, tag = "25")]
    functions: Vec<Vec<u8>>,
}

/// The suite's folder, or None (after printing why) when this machine has none.
fn suite_dir() -> Option<PathBuf> {
    let missing = |why: String| -> Option<PathBuf> {
        if std::env::var_os("CI").is_some() {
            panic!("CI is set but ONNX's node tests are not here: {why}");
        }
        // Straight to stderr: the test harness shows eprintln! output only for failures,
        // and a skip must be seen.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipping ONNX's node tests: {why} (install them with \
             `python3 -m pip install onnx=={ONNX_VERSION}`, or set {SUITE_ENV} to their folder)"
        );
        None
    };
    if let Some(d) = std::env::var_os(SUITE_ENV) {
        let d = PathBuf::from(d);
        return match d.is_dir() {
            true => Some(d),
            false => missing(format!("{SUITE_ENV}={} is not a folder", d.display())),
        };
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import os, onnx; print(onnx.__version__); print(os.path.dirname(onnx.__file__))",
        ])
        .output();
    let out = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            let last = err.lines().last().unwrap_or("").to_string();
            return missing(format!("python3 cannot import onnx ({last})"));
        }
        Err(e) => return missing(format!("python3 does not run ({e})")),
    };
    let mut lines = out.lines();
    let (version, pkg) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
    if version != ONNX_VERSION {
        // Another release has other cases: the doc's counts would not hold.
        return missing(format!(
            "python3's onnx is {version}, and {DOC} describes onnx {ONNX_VERSION}'s suite"
        ));
    }
    let d = Path::new(pkg).join("backend/test/data/node");
    match d.is_dir() {
        true => Some(d),
        false => missing(format!("onnx {version} has no {}", d.display())),
    }
}

fn decode_model(dir: &Path) -> Result<(ModelProto, ModelExtras), String> {
    let bytes = std::fs::read(dir.join("model.onnx")).map_err(|e| e.to_string())?;
    let m = ModelProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    let x = ModelExtras::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    Ok((m, x))
}

/// An op's name as the importer names it: "Conv", or "domain::Op" outside ai.onnx.
fn op_key(domain: &str, op: &str) -> String {
    if domain.is_empty() || domain == "ai.onnx" {
        op.to_string()
    } else {
        format!("{domain}::{op}")
    }
}

/// Whether graphrun has the op itself (the importer may also rewrite others into its ops:
/// the doc counts those too, from the cases that got past the importer).
fn implemented(op: &str) -> bool {
    graphrun::onnx::imports(op)
}

fn cases(suite: &Path) -> Vec<Case> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(suite)
        .unwrap_or_else(|e| panic!("{}: {e}", suite.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("model.onnx").exists())
        .collect();
    dirs.sort();
    let mut out = vec![];
    let mut single_op: HashMap<String, String> = HashMap::new();
    let mut models = vec![];
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (m, x) = decode_model(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let g = m.graph.clone().unwrap_or_default();
        if let [n] = &g.node[..] {
            single_op.insert(name.clone(), op_key(&n.domain, &n.op_type));
        }
        models.push((name, dir, m, x));
    }
    for (name, dir, m, x) in models {
        let g = m.graph.clone().unwrap_or_default();
        // An `_expanded` case may be one node too (CastLike expands to one Cast): the
        // case it expands names the op.
        let base = name.split("_expanded").next().unwrap_or(&name);
        let op = single_op
            .get(base)
            .or_else(|| single_op.get(&name))
            .cloned()
            .or_else(|| g.node.first().map(|n| op_key(&n.domain, &n.op_type)))
            .unwrap_or_else(|| "(no node)".into());
        let blocked = blocked(&m, &x);
        let ops = g
            .node
            .iter()
            .map(|n| op_key(&n.domain, &n.op_type))
            .collect();
        let opset = m
            .opset_import
            .iter()
            .filter(|o| o.domain.is_empty() || o.domain == "ai.onnx")
            .map(|o| o.version)
            .max()
            .unwrap_or(0);
        out.push(Case {
            name,
            op,
            dir,
            ops,
            opset,
            blocked,
        });
    }
    out
}

/// Why the model cannot run in graphrun, seen from the model alone: not a tensor model, or
/// element types graphrun lacks. (Which operators it lacks, the importer says.)
fn blocked(m: &ModelProto, x: &ModelExtras) -> Option<Fail> {
    let g = m.graph.clone().unwrap_or_default();
    let io: Vec<&ValueInfoProto> = g.input.iter().chain(&g.output).collect();
    let mut kinds = BTreeSet::new();
    for v in &io {
        match v.r#type.as_ref() {
            Some(t) if t.sequence_of() == Some(None) => kinds.insert("sequences".to_string()),
            Some(t)
                if t.optional_type.is_some()
                    && t.tensor().is_none()
                    && t.sequence_of().is_none() =>
            {
                kinds.insert("optionals".to_string())
            }
            Some(t) if t.map_type.is_some() => kinds.insert("maps".to_string()),
            Some(t) if t.sparse_tensor_type.is_some() => kinds.insert("sparse tensors".to_string()),
            _ => false,
        };
    }
    let sub: BTreeSet<&str> = g
        .node
        .iter()
        .filter(|n| {
            n.attribute
                .iter()
                .any(|a| a.g.is_some() || !a.graphs.is_empty())
        })
        // If, Loop, Scan and FlexAttention are imported (their graphs written out).
        .filter(|n| !graphrun::onnx::imports_in(&n.domain, &n.op_type))
        .map(|n| n.op_type.as_str())
        .collect();
    if !sub.is_empty() {
        let ops: Vec<&str> = sub.into_iter().collect();
        kinds.insert(format!("subgraphs ({})", ops.join(", ")));
    }
    if !x.functions.is_empty() {
        kinds.insert("model-local functions".into());
    }
    if !kinds.is_empty() {
        return Some(Fail {
            cat: Category::NotTensor,
            reason: kinds.into_iter().collect::<Vec<_>>().join(", "),
        });
    }
    let bad: BTreeSet<String> = io
        .iter()
        .filter_map(|v| v.r#type.as_ref()?.tensor_type.as_ref())
        .map(|t| t.elem_type)
        .filter(|&t| DType::from_onnx(t as i64).is_none())
        .map(dtype_name)
        .collect();
    if !bad.is_empty() {
        return Some(Fail {
            cat: Category::Dtype,
            reason: bad.into_iter().collect::<Vec<_>>().join(", "),
        });
    }
    None
}

/// The ops the importer's error names as unsupported: "graphrun does not support 2 ops of
/// this model (3 nodes): Conv (1 node: 'a'); Pad (2 nodes: 'b', 'c')".
fn unsupported_ops(err: &str) -> Option<Vec<String>> {
    let at = err.find("graphrun does not support ")?;
    let rest = &err[at..];
    let list = &rest[rest.find("): ")? + 3..];
    Some(
        list.split("; ")
            .map(|item| item.split(" (").next().unwrap_or(item).to_string())
            .collect(),
    )
}

/// An ONNX element type's name (graphrun's names stop at FLOAT4E2M1).
fn dtype_name(code: i32) -> String {
    match code {
        24 => "FLOAT8E8M0".into(),
        25 => "UINT2".into(),
        26 => "INT2".into(),
        _ => onnx_dtype_name(code as i64),
    }
}

/// The wgpu backend's refusal of a type WGSL lacks.
const NOT_ON_WGPU: &str = "not supported by the wgpu backend";

/// The KNOWN entry of a case.
fn known(case: &str) -> Option<&'static str> {
    KNOWN
        .iter()
        .find_map(|(pat, why)| glob(pat, case).then_some(*why))
}

/// Whether `s` matches `pat`, where '*' stands for any run of characters.
fn glob(pat: &str, s: &str) -> bool {
    let parts: Vec<&str> = pat.split('*').collect();
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if parts.len() == 1 {
        return s == pat;
    }
    if s.len() < first.len() + last.len() || !s.starts_with(first) || !s.ends_with(last) {
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

/// A TensorProto read from `p`. numpy has no bfloat16, and ONNX releases before 1.19
/// wrote bfloat16 test data as UINT16 bit patterns; those are read back as the bfloat16
/// they are.
fn tensor_of(mut t: TensorProto, p: &Path, declared: Option<i32>) -> Result<Tensor, String> {
    const UINT16: i32 = 4;
    const BFLOAT16: i32 = 16;
    if t.data_type == UINT16 && declared == Some(BFLOAT16) {
        t.data_type = BFLOAT16;
    }
    let what = p.file_name().unwrap().to_string_lossy().into_owned();
    from_proto(&t, Path::new("."), &what).map_err(|e| e.to_string())
}

fn elem_type(v: &ValueInfoProto) -> Option<i32> {
    Some(v.r#type.as_ref()?.tensor()?.elem_type)
}

/// ONNX's `SequenceProto`, the fields a sequence of tensors uses.
#[derive(Clone, PartialEq, Message)]
struct SequenceProto {
    #[prost(message, repeated, tag = "3")]
    tensor_values: Vec<TensorProto>,
}

/// ONNX's `OptionalProto`, the fields an optional of a tensor or sequence uses.
#[derive(Clone, PartialEq, Message)]
struct OptionalProto {
    #[prost(message, optional, tag = "3")]
    tensor_value: Option<TensorProto>,
    #[prost(message, optional, tag = "5")]
    sequence_value: Option<SequenceProto>,
}

/// The file `p` holding value `v` as the graph declares it: a TensorProto, or for a
/// sequence a SequenceProto whose elements are the values `name[i]` (graphrun's form of
/// a sequence), or an OptionalProto holding either (nothing where it is empty).
fn read_value(p: &Path, v: &ValueInfoProto) -> Result<Vec<(String, Tensor)>, String> {
    let ty = v.r#type.clone().unwrap_or_default();
    let declared = elem_type(v);
    let bytes = std::fs::read(p).map_err(|e| e.to_string())?;
    let elements = |s: SequenceProto, declared| -> Result<Vec<(String, Tensor)>, String> {
        s.tensor_values
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                Ok((
                    graphrun::onnx::element_name(&v.name, i),
                    tensor_of(t, p, declared)?,
                ))
            })
            .collect()
    };
    if let Some(elem) = ty.sequence_of() {
        let declared = elem.map(|t| t.elem_type);
        let s = if ty.optional_type.is_some() {
            let o = OptionalProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
            o.sequence_value.unwrap_or_default()
        } else {
            SequenceProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?
        };
        return elements(s, declared);
    }
    let t = if ty.optional_type.is_some() {
        let o = OptionalProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
        match o.tensor_value {
            Some(t) => t,
            None => return Ok(vec![]),
        }
    } else {
        TensorProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?
    };
    Ok(vec![(v.name.clone(), tensor_of(t, p, declared)?)])
}

/// Runs one case on one backend: every data set, every input fed as the set gives it.
fn run_case(c: &Case, backend: BackendKind) -> Result<(), String> {
    let bytes = std::fs::read(c.dir.join("model.onnx")).map_err(|e| e.to_string())?;
    let m = ModelProto::decode(bytes.as_slice()).map_err(|e| e.to_string())?;
    let g = m.graph.clone().unwrap_or_default();
    let session_of = |opts: &ImportOptions| -> Result<Session, String> {
        let graph = graphrun::onnx::from_bytes_with(&bytes, &c.name, &c.dir, opts)
            .map_err(|e| e.to_string())?;
        let (fused, _) =
            passes::optimize(&graph, &PassOptions::default()).map_err(|e| e.to_string())?;
        let opts = SessionOptions {
            backend,
            ..SessionOptions::unfused()
        };
        Session::new(fused, opts).map_err(|e| e.to_string())
    };
    // A sequence input's elements are inputs of their own, as many as are fed: such a
    // model is imported for each data set's.
    let sequences = g
        .input
        .iter()
        .any(|v| v.r#type.as_ref().is_some_and(|t| t.sequence_of().is_some()));
    let mut session = if sequences {
        None
    } else {
        Some(session_of(&ImportOptions::default())?)
    };
    let mut sets: Vec<PathBuf> = std::fs::read_dir(&c.dir)
        .map_err(|e| e.to_string())?
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    sets.sort();
    // input_<i>.pb feeds the i-th graph input that has no initializer, as ONNX's runner
    // does; output_<i>.pb is the i-th graph output.
    let inits: BTreeSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    let inputs: Vec<&ValueInfoProto> = g
        .input
        .iter()
        .filter(|v| !inits.contains(v.name.as_str()))
        .collect();
    for set in sets {
        let mut feeds = HashMap::new();
        for (i, v) in inputs.iter().enumerate() {
            let pb = set.join(format!("input_{i}.pb"));
            if pb.exists() {
                feeds.extend(read_value(&pb, v)?);
            }
        }
        if sequences {
            let mut opts = ImportOptions::default();
            for (k, t) in &feeds {
                opts.input_shapes.insert(k.clone(), t.shape().to_vec());
            }
            session = Some(session_of(&opts)?);
        }
        let got = session
            .as_mut()
            .unwrap()
            .run(&feeds)
            .map_err(|e| e.to_string())?;
        for (i, v) in g.output.iter().enumerate() {
            let pb = set.join(format!("output_{i}.pb"));
            if !pb.exists() {
                continue;
            }
            let want = read_value(&pb, v)?;
            // A sequence output is its elements, `name[i]`: as many as expected.
            let elements = got
                .iter()
                .filter(|(n, _)| n.starts_with(&format!("{}[", v.name)))
                .count();
            if elements > 0 && elements != want.len() {
                return Err(format!(
                    "output '{}': {elements} elements, expected {}",
                    v.name,
                    want.len()
                ));
            }
            for (name, want) in want {
                let Some((_, t)) = got.iter().find(|(n, _)| *n == name) else {
                    return Err(format!("output '{name}' is missing from the results"));
                };
                compare(t, &want).map_err(|e| format!("output '{name}': {e}"))?;
            }
        }
    }
    Ok(())
}

/// The marker `compare` starts its value mismatches with.
const MISMATCH: &str = "values differ";

/// Floating outputs within the dtype's relative tolerance, the others exactly. Where the
/// reference is NaN or infinite the output must be the same (common::rel_err).
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
            false => Err(format!("{MISMATCH} (compared exactly)")),
        };
    }
    let tol = match want.dtype() {
        DType::F64 => 1e-10,
        DType::F32 => 1e-5,
        _ => 1e-2,
    };
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let e = common::rel_err(&g, &w);
    if e <= tol {
        return Ok(());
    }
    // What ONNX's own runner would say (numpy's assert_allclose, NaN equal to NaN).
    let onnx_ok = g.iter().zip(&w).all(|(&o, &r)| {
        (o.is_nan() && r.is_nan()) || o == r || (o - r).abs() <= 1e-7 + 1e-3 * r.abs()
    });
    let also = if onnx_ok {
        "; within ONNX's rtol 1e-3/atol 1e-7"
    } else {
        ""
    };
    Err(format!(
        "{MISMATCH}: relative error {e:.1e} > {tol:.0e}{also}"
    ))
}

/// The first line of an error, without the case's folder.
fn first_line(e: &str, dir: &Path) -> String {
    let first = e.lines().next().unwrap_or("");
    first
        .replace(&format!("{}/", dir.display()), "")
        .replace(&format!("{}", dir.display()), "")
}

/// The outcome of one case on one backend, categorised.
fn outcome(c: &Case, backend: BackendKind) -> (Outcome, Option<String>) {
    if let Some(f) = &c.blocked {
        return (Err(f.clone()), None);
    }
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_case(c, backend)));
    let (err, panic) = match run {
        Ok(Ok(())) => return (Ok(()), None),
        Ok(Err(e)) => (first_line(&e, &c.dir), None),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            let line = format!("graphrun panicked: {}", msg.lines().next().unwrap_or(""));
            (line.clone(), Some(line))
        }
    };
    // Dtype and unsupported ops first (ALL's order), then the known exceptions.
    let dtype = err.contains("which graphrun does not support");
    let opset =
        err.contains("graphrun implements opsets") || err.contains("imports no ai.onnx opset");
    let unsupported = unsupported_ops(&err).or_else(|| {
        // The importer refuses the opset before it looks at the nodes: then the ops it
        // lacks are those of the model that graphrun does not have.
        let missing: Vec<String> = c.ops.iter().filter(|o| !implemented(o)).cloned().collect();
        (opset && !missing.is_empty()).then_some(missing)
    });
    let (cat, reason) = if dtype {
        // Grouped: the element type alone.
        let named = ["element type ", "dtype "].iter().find_map(|k| {
            let at = err.find(k)? + k.len();
            Some(err[at..].split([',', ' ']).next()?.to_string())
        });
        (Category::Dtype, named.unwrap_or(err))
    } else if let Some(ops) = unsupported {
        (Category::Unsupported, ops.join(", "))
    } else if err.contains("does not carry sequences")
        || err.contains("graphrun takes sequences in")
        || err.contains("is a sequence; graphrun carries")
    {
        (
            Category::NotTensor,
            "sequences carried through Scan, or through a Loop that may stop early".into(),
        )
    } else if err.contains("is a sequence; graphrun writes sequences out") {
        (
            Category::NotTensor,
            "a sequence graph input fed with no elements".into(),
        )
    } else if err.contains("an empty optional in") {
        (
            Category::NotTensor,
            "an empty optional or a sequence, chosen by a condition fed at run time".into(),
        )
    } else if let Some(why) = known(&c.name).filter(|_| !err.contains(NOT_ON_WGPU)) {
        // (A known case that stops earlier on a type WebGPU lacks counts under that.)
        (Category::Known, format!("{why} (graphrun: {err})"))
    } else if opset {
        // Grouped: the opset alone.
        (Category::Opset, format!("opset {}", c.opset))
    } else if err.contains("must be known when the plan is made")
        || err.contains("is not known when the model is loaded")
    {
        (Category::RunTimeShapes, err)
    } else if err.contains(NOT_ON_WGPU) {
        (Category::BackendDtype, err)
    } else if err.contains(MISMATCH) {
        (Category::Numerical, err)
    } else {
        (Category::Other, err)
    };
    (Err(Fail { cat, reason }), panic)
}

/// Outcomes by (case, backend name).
type Results = BTreeMap<(String, &'static str), Outcome>;

/// "1,765".
fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn pct(n: usize, of: usize) -> String {
    format!("{:.1}%", 100.0 * n as f64 / of.max(1) as f64)
}

/// The heading under which the doc lists every case that does not pass; the regression
/// check reads the cases named after it.
const FAILING_HEADING: &str = "## Cases that do not pass";

fn doc(cases: &[Case], results: &Results) -> String {
    let names: Vec<&'static str> = DOC_BACKENDS.iter().map(|b| b.name()).collect();
    let total = cases.len();
    let res = |c: &Case, b: &str| &results[&(c.name.clone(), name_of(b))];
    let mut s = String::from("# ONNX conformance\n\n");
    s += &format!(
        "graphrun against ONNX's own backend node tests: the whole suite as the `onnx` \
         {ONNX_VERSION} Python package ships it (`onnx/backend/test/data/node/`, {} cases), \
         on the CPU and on WebGPU (CI runs the latter on Mesa's software Vulkan, lavapipe). \
         This file is generated by `tests/onnx_conformance.rs`; CI fails when it is stale \
         and when a case it lists as passing fails. Regenerate it with \
         `UPDATE_CONFORMANCE=1 cargo test --test onnx_conformance` (the test finds the suite \
         through `python3 -c \"import onnx\"`, or `{SUITE_ENV}` set to the `node` folder).\n\n",
        thousands(total)
    );
    s += "Each case's `model.onnx` is imported as it is, optimized by the default passes and run \
          on every data set of the case, each graph input fed from the set's `input_<i>.pb`. \
          Every output is compared with ONNX's expected output: floating outputs by relative \
          error ‖out − ref‖/‖ref‖ ≤ 1e-5 for f32, 1e-2 for f16 and bf16, 1e-10 for f64 (where \
          the expected value is NaN or infinite, the output must be the same), integer and \
          bool outputs exactly. Where a CUDA device is present the test also runs every case \
          on CUDA and checks that its outcomes are the CPU's (the test lists the exceptions, \
          each with its reason).\n\n";
    s += "## Totals\n\n| backend | passing | of the suite |\n|---|---|---|\n";
    for b in &names {
        let n = cases.iter().filter(|c| res(c, b).is_ok()).count();
        s += &format!(
            "| {b} | {} of {} | {} |\n",
            thousands(n),
            thousands(total),
            pct(n, total)
        );
    }
    s += &format!(
        "\nWhy the others do not pass (a case counts under the first reason that applies, in \
         the order below):\n\n| reason | {} |\n|---|{}\n",
        names.join(" | "),
        "---|".repeat(names.len())
    );
    for cat in Category::ALL {
        let cols: Vec<String> = names
            .iter()
            .map(|b| {
                cases
                    .iter()
                    .filter(|c| matches!(res(c, b), Err(f) if f.cat == cat))
                    .count()
                    .to_string()
            })
            .collect();
        s += &format!("| {} | {} |\n", cat.title(), cols.join(" | "));
    }

    // Per operator.
    let mut per_op: BTreeMap<&str, Vec<&Case>> = BTreeMap::new();
    for c in cases {
        per_op.entry(&c.op).or_default().push(c);
    }
    s += "\n## Per operator\n\nEach case counts once, under the operator it tests: its one \
          node's operator, or for an `_expanded` case (the operator written as its function \
          body of simpler operators) the operator it expands. \"in graphrun\" says whether \
          graphrun's importer takes the operator.\n\n";
    s += &format!(
        "| operator | in graphrun | cases | {} |\n|---|---|---|{}\n",
        names.join(" | "),
        "---|".repeat(names.len())
    );
    // The ops the importer took: those of the cases that got past its checks of the
    // model (it may rewrite ops graphrun does not have into ops it has).
    let imported: BTreeSet<&str> = cases
        .iter()
        .filter(|c| match res(c, names[0]) {
            Ok(()) => true,
            Err(f) => !matches!(
                f.cat,
                Category::NotTensor | Category::Dtype | Category::Unsupported | Category::Opset
            ),
        })
        .flat_map(|c| c.ops.iter().map(String::as_str))
        .collect();
    for (op, cs) in &per_op {
        let cols: Vec<String> = names
            .iter()
            .map(|b| cs.iter().filter(|c| res(c, b).is_ok()).count().to_string())
            .collect();
        let has = if implemented(op) || imported.contains(op) {
            "yes"
        } else {
            ""
        };
        s += &format!("| `{op}` | {has} | {} | {} |\n", cs.len(), cols.join(" | "));
    }
    let untested: Vec<String> = graphrun::graph::op::OP_NAMES
        .iter()
        .filter(|op| implemented(op) && !per_op.contains_key(*op))
        .map(|op| format!("`{op}`"))
        .collect();
    if !untested.is_empty() {
        s += &format!(
            "\ngraphrun's operators with no case of their own in this suite: {}.\n",
            untested.join(", ")
        );
    }

    // Every case that does not pass.
    s += &format!(
        "\n{FAILING_HEADING}\n\nBy reason; a line marked with backends applies to those only, \
         the others to {}.\n",
        names.join(" and ")
    );
    // (category, reason, backends) → cases, for grouped categories; (category) → lines.
    for cat in Category::ALL {
        let mut groups: BTreeMap<(String, Vec<&str>), Vec<&Case>> = BTreeMap::new();
        let mut lines: Vec<String> = vec![];
        let mut count = BTreeMap::new();
        for c in cases {
            // The backends on which the case fails with this category, by reason.
            let mut by_reason: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for b in &names {
                if let Err(f) = res(c, b) {
                    if f.cat == cat {
                        by_reason.entry(&f.reason).or_default().push(b);
                        *count.entry(*b).or_insert(0) += 1;
                    }
                }
            }
            for (reason, bs) in by_reason {
                let mark = mark(&bs, &names);
                if cat.grouped() {
                    groups
                        .entry((reason.to_string(), bs.clone()))
                        .or_default()
                        .push(c);
                } else {
                    lines.push(format!("- {mark}`{}` ({}): {reason}\n", c.name, c.op));
                }
            }
        }
        if count.is_empty() {
            continue;
        }
        let counts: Vec<String> = names
            .iter()
            .map(|b| format!("{b} {}", count.get(b).copied().unwrap_or(0)))
            .collect();
        s += &format!(
            "\n### {} ({})\n\n{}\n\n",
            cat.title(),
            counts.join(", "),
            cat.blurb()
        );
        let mut grouped: Vec<_> = groups.into_iter().collect();
        // Largest groups first: the ops that would unlock the most cases lead.
        grouped.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
        for ((reason, bs), cs) in grouped {
            let mark = mark(&bs, &names);
            let n = cs.len();
            let list: Vec<String> = cs.iter().map(|c| format!("`{}`", c.name)).collect();
            s += &format!(
                "- {mark}**{reason}** ({n} case{}): {}\n",
                if n == 1 { "" } else { "s" },
                list.join(", ")
            );
        }
        for l in lines {
            s += &l;
        }
    }
    s
}

/// What starts a line that applies to some backends only: "(wgpu only) ".
fn mark(bs: &[&str], all: &[&str]) -> String {
    if bs.len() == all.len() {
        String::new()
    } else {
        format!("({} only) ", bs.join(", "))
    }
}

/// The `'static` name of a doc backend.
fn name_of(b: &str) -> &'static str {
    BackendKind::parse(b).expect("a backend name").name()
}

/// The cases the doc lists as not passing on `backend`, or None when the doc has no such
/// list (no doc yet).
fn doc_failing(text: &str, backend: &str) -> Option<BTreeSet<String>> {
    let start = text.find(FAILING_HEADING)?;
    let mut out = BTreeSet::new();
    for line in text[start..].lines().filter(|l| l.starts_with("- ")) {
        // A line for some backends only starts "- (wgpu only) " (`mark`).
        let only = line
            .strip_prefix("- (")
            .and_then(|rest| rest.find(" only) ").map(|end| &rest[..end]));
        if let Some(bs) = only {
            if !bs.split(", ").any(|b| b == backend) {
                continue;
            }
        }
        for (k, part) in line.split('`').enumerate() {
            if k % 2 == 1 && part.starts_with("test_") {
                out.insert(part.to_string());
            }
        }
    }
    Some(out)
}

#[test]
fn onnx_node_tests() {
    let Some(suite) = suite_dir() else { return };
    let cases = cases(&suite);
    assert_eq!(
        cases.len(),
        SUITE_CASES,
        "{} holds {} cases; onnx {ONNX_VERSION}'s suite has {SUITE_CASES}",
        suite.display(),
        cases.len()
    );
    let ran = common::backends();
    let mut results: Results = BTreeMap::new();
    let mut problems = vec![];
    let mut panics = vec![];
    for &backend in &ran {
        let t0 = std::time::Instant::now();
        for c in &cases {
            let (r, panic) = outcome(c, backend);
            if let Some(p) = panic {
                panics.push(format!("{} on {}: {p}", c.name, backend.name()));
            }
            if r.is_ok() && known(&c.name).is_some() {
                problems.push(format!(
                    "{} passes on {} but is listed in KNOWN: remove the entry",
                    c.name,
                    backend.name()
                ));
            }
            results.insert((c.name.clone(), backend.name()), r);
        }
        let pass = cases
            .iter()
            .filter(|c| results[&(c.name.clone(), backend.name())].is_ok())
            .count();
        eprintln!(
            "{}: {pass} of {} cases pass ({:.1} s)",
            backend.name(),
            cases.len(),
            t0.elapsed().as_secs_f64()
        );
    }
    if !panics.is_empty() {
        eprintln!("graphrun panicked (a bug):\n{}", panics.join("\n"));
    }

    // CUDA must give the CPU's outcomes.
    if ran.contains(&BackendKind::Cuda) {
        for c in &cases {
            let cpu = results[&(c.name.clone(), "cpu")].is_ok();
            let cuda = results[&(c.name.clone(), "cuda")].clone();
            let listed = CUDA_DIFFERS.iter().any(|(p, _)| glob(p, &c.name));
            // Ops other than casts and moves on the narrow storage types (8-bit floats, 4-
            // and 2-bit integers): CUDA refuses them by name where a CPU kernel may take
            // them generically.
            let narrow = cuda
                .as_ref()
                .err()
                .is_some_and(|f| f.reason.contains(CPU_ONLY));
            if narrow && !listed {
                continue;
            }
            match (cpu == cuda.is_ok(), listed) {
                (false, false) => problems.push(format!(
                    "{}: cuda {} where cpu {}{}",
                    c.name,
                    if cuda.is_ok() { "passes" } else { "fails" },
                    if cpu { "passes" } else { "fails" },
                    cuda.err()
                        .map(|f| format!(" ({})", f.reason))
                        .unwrap_or_default()
                )),
                (true, true) => problems.push(format!(
                    "{}: cuda and cpu agree, but CUDA_DIFFERS lists it: remove the entry",
                    c.name
                )),
                _ => {}
            }
        }
    }

    // Regressions: a case the doc lists as passing on a backend that ran here as CI runs
    // it.
    let current = std::fs::read_to_string(DOC).unwrap_or_default();
    let as_in_ci =
        |b: &BackendKind| ran.contains(b) && (*b != BackendKind::Wgpu || wgpu_software());
    for b in DOC_BACKENDS.iter().filter(|b| as_in_ci(b)) {
        let Some(failing) = doc_failing(&current, b.name()) else {
            eprintln!("{DOC} lists no cases: no regression check");
            break;
        };
        for c in &cases {
            if failing.contains(&c.name) {
                continue;
            }
            if let Err(f) = &results[&(c.name.clone(), b.name())] {
                problems.push(format!(
                    "regression: {} passed on {} ({DOC}) and now fails: {}",
                    c.name,
                    b.name(),
                    f.reason
                ));
            }
        }
    }

    match DOC_BACKENDS.iter().find(|b| !as_in_ci(b)) {
        // Without that backend here (no Vulkan), or on a GPU's Vulkan driver (other
        // features than lavapipe's), the doc cannot be checked; CI has it.
        Some(b) => eprintln!(
            "not checking {DOC}: backend {} is not here as CI runs it",
            b.name()
        ),
        None => check_doc(&doc(&cases, &results), &current, &mut problems),
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Whether the WebGPU adapter is a software one (lavapipe, as in CI): the doc records its
/// outcomes, and a GPU's driver may differ (f16, for one).
#[cfg(feature = "wgpu")]
fn wgpu_software() -> bool {
    graphrun::backends::wgpu::device::gpu()
        .is_ok_and(|g| format!("{:?}", g.info.device_type) == "Cpu")
}
#[cfg(not(feature = "wgpu"))]
fn wgpu_software() -> bool {
    false
}

/// Writes the doc (UPDATE_CONFORMANCE) or records a problem when it is stale.
fn check_doc(text: &str, current: &str, problems: &mut Vec<String>) {
    if std::env::var_os("UPDATE_CONFORMANCE").is_some() {
        std::fs::write(DOC, text).unwrap();
    } else if current != text {
        problems.push(format!(
            "{DOC} is stale: run UPDATE_CONFORMANCE=1 cargo test --test onnx_conformance"
        ));
    }
}

/// The doc's failing lists read back per backend, as the regression check reads them.
#[test]
fn doc_failing_reads_backend_marks() {
    let text = format!(
        "# x\n\n- `test_not_listed` outside the list\n\n{FAILING_HEADING}\n\n### A\n\n\
         - **Conv, Pad** (2 cases): `test_a`, `test_b`\n\
         - (wgpu only) `test_c` (Pow): node 'p' refers to `x`\n\
         - (cpu only) **opset 25** (1 case): `test_d`\n"
    );
    let cpu = doc_failing(&text, "cpu").unwrap();
    let wgpu = doc_failing(&text, "wgpu").unwrap();
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(cpu, names(&["test_a", "test_b", "test_d"]));
    assert_eq!(wgpu, names(&["test_a", "test_b", "test_c"]));
    assert_eq!(doc_failing("# no list\n", "cpu"), None);
}

#[test]
fn unsupported_ops_reads_the_importer_error() {
    let e = "graphrun does not support 2 ops of this model (3 nodes): Conv (1 node: 'a'); \
             ai.onnx.ml::Binarizer (2 nodes: 'b', 'c')";
    assert_eq!(
        unsupported_ops(e),
        Some(vec![
            "Conv".to_string(),
            "ai.onnx.ml::Binarizer".to_string()
        ])
    );
    assert_eq!(
        unsupported_ops(
            "initializer 'w' has element type UINT8, which graphrun does not support (FLOAT, ...)"
        ),
        None
    );
    assert!(
        glob("test_sce_*_mean", "test_sce_NCd1_mean")
            && !glob("test_sce_*_mean", "test_sce_NCd1_mean_expanded")
    );
}
