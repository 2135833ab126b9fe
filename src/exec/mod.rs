//! The executor: plans (schedule, lifetimes, buffer reuse) and sessions that run them on
//! a backend. This is the only place where graphs and devices meet.

pub mod launch;
#[cfg(feature = "cuda")]
pub mod parallel;
#[cfg(not(feature = "cuda"))]
#[path = "parallel_off.rs"]
pub mod parallel;
pub mod plan;
pub mod session;
mod staged;

pub use parallel::DataParallel;
pub use plan::{Plan, PlanKey};
pub use session::{Session, SessionOptions};

use crate::error::Result;
use crate::graph::infer::PlanTimeInput;
use crate::graph::{Dim, Graph, InputInfo, Op};
use crate::rng::Rng;
use crate::tensor::{DType, Elem, Tensor};
use std::collections::{BTreeMap, HashMap};

pub use crate::files::write_atomic;

pub use crate::graph::eval::PLAN_INPUT_LIMIT;

/// Splits every feed along axis 0 into `n` equal parts (data-parallel shards, the
/// micro-batches of gradient accumulation); `parts` names them in the error.
pub fn split_feeds(
    feeds: &HashMap<String, Tensor>,
    n: usize,
    parts: &str,
) -> Result<Vec<HashMap<String, Tensor>>> {
    if n == 0 {
        crate::bail!(Input, "a batch cannot split into 0 {parts}");
    }
    let mut out: Vec<HashMap<String, Tensor>> = (0..n).map(|_| HashMap::new()).collect();
    for (name, t) in feeds {
        let rows = t.shape().first().copied().unwrap_or(0);
        if t.shape().is_empty() || rows % n != 0 {
            crate::bail!(
                Input,
                "input '{name}' {}: its first axis (the batch) must split evenly over {n} {parts}",
                crate::tensor::fmt_shape(t.shape())
            );
        }
        let per = rows / n;
        for (r, part) in out.iter_mut().enumerate() {
            let rows: Vec<usize> = (r * per..(r + 1) * per).collect();
            part.insert(name.clone(), t.take_rows(&rows)?);
        }
    }
    Ok(out)
}

/// Every pass, with the CPU backend's reference evaluator for the values inference and
/// constant folding compute on the host (the passes themselves know no backend).
impl Default for crate::passes::PassOptions {
    fn default() -> Self {
        crate::passes::PassOptions {
            disabled: vec![],
            training: false,
            eval: &crate::backends::cpu::HOST_EVAL,
        }
    }
}

/// Inference, parameters only, with the CPU backend's reference evaluator.
impl Default for crate::passes::autodiff::BackwardOptions {
    fn default() -> Self {
        crate::passes::autodiff::BackwardOptions {
            training: false,
            inputs: false,
            eval: &crate::backends::cpu::HOST_EVAL,
        }
    }
}

/// What a plan-time input decides, for messages: "the shape of node 'r' (Reshape)".
pub fn plan_input_use(g: &Graph, p: &PlanTimeInput) -> String {
    let n = &g.nodes[p.node];
    let what = crate::graph::infer::shape_inputs(&n.op)
        .iter()
        .find(|(k, _)| *k == p.slot)
        .map_or("a shape-deciding input", |(_, w)| *w);
    format!("the {what} of {}", n.describe())
}

/// The fed values of the plan-time inputs `inputs` (`infer::plan_time_inputs` of `g`):
/// small integer tensors (any small tensor for NonZero's and Unique's input), whose values
/// the plan is made for.
pub fn plan_values(
    g: &Graph,
    inputs: &[PlanTimeInput],
    feeds: &HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for p in inputs {
        let why = || {
            format!(
                "input '{}' decides {} (the plan is made for its value)",
                p.name,
                plan_input_use(g, p)
            )
        };
        let Some(t) = feeds.get(&p.name) else {
            crate::bail!(Input, "{}: feed it", why());
        };
        // Range takes float bounds, and NonZero and Unique (computed when planning) any
        // data; the other shape inputs are checked for integers by the node that reads
        // them.
        let any_dtype = crate::graph::infer::computed_at_plan_time(&g.nodes[p.node].op);
        if !any_dtype && (t.dtype() == DType::Bool || !(t.dtype().is_int() || only_ranges(g, p))) {
            crate::bail!(
                Input,
                "{}: it must be an i64 or i32 tensor, got {}{}",
                why(),
                t.dtype(),
                crate::tensor::fmt_shape(t.shape())
            );
        }
        if t.numel() > PLAN_INPUT_LIMIT {
            crate::bail!(
                Input,
                "{}: it must hold at most {PLAN_INPUT_LIMIT} elements, got {}{}",
                why(),
                t.dtype(),
                crate::tensor::fmt_shape(t.shape())
            );
        }
        out.insert(p.name.clone(), t.clone());
    }
    Ok(out)
}

/// Whether every shape-deciding use of plan-time input `p` is a Range bound.
fn only_ranges(g: &Graph, p: &PlanTimeInput) -> bool {
    g.nodes
        .iter()
        .filter(|n| n.inputs.contains(&p.name))
        .all(|n| n.op == Op::Range)
}

/// Resolves an input's declared shape with the given symbol bindings.
pub fn concrete_shape(i: &InputInfo, dims: &BTreeMap<String, usize>) -> Result<Vec<usize>> {
    i.shape
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => Ok(*n),
            Dim::Sym(s) => dims.get(s).copied().ok_or_else(|| {
                crate::err!(Input, "symbolic dim '{s}' of input '{}' is not bound: feed the input, bind it (SessionOptions::dims; --dim {s}=N on the command line), or add a default under dims:", i.name)
            }),
        })
        .collect()
}

/// Adds the default of every graph input that has one and is not in `feeds`.
pub fn fill_defaults(g: &crate::graph::Graph, feeds: &mut HashMap<String, Tensor>) {
    for i in &g.inputs {
        if let (Some(d), false) = (&i.default, feeds.contains_key(&i.name)) {
            feeds.insert(i.name.clone(), d.clone());
        }
    }
}

/// Seeded random data for one input: floats uniform in its `range` (default [-1, 1)),
/// integers uniform in `range` (default [0, 2)), bools fair coins. Each input has its own
/// stream, so the data of one input does not depend on the others.
pub fn random_input(i: &InputInfo, shape: &[usize], seed: u64) -> Result<Tensor> {
    let mut r = Rng::for_name(seed, &i.name);
    let mut t = Tensor::try_zeros(i.dtype, shape, &format!("input '{}'", i.name))?;
    let mut draw: Box<dyn FnMut() -> f64> = match i.dtype {
        d if d.is_float() => {
            let (lo, hi) = i.range.unwrap_or((-1.0, 1.0));
            Box::new(move || r.uniform_in(lo, hi))
        }
        DType::Bool => Box::new(move || (r.next_u64() & 1) as f64),
        _ => {
            let (lo, hi) = i.range.unwrap_or((0.0, 2.0));
            let (lo, hi) = (lo.ceil() as i64, hi.ceil() as i64);
            if hi <= lo {
                crate::bail!(Input, "input '{}': range holds no integer", i.name);
            }
            Box::new(move || r.int_in(lo, hi) as f64)
        }
    };
    crate::with_any!(i.dtype, T => {
        for v in t.as_mut_slice::<T>() {
            *v = T::from_f64(draw());
        }
    });
    Ok(t)
}

/// Binds every symbolic dim: from fed inputs first, then `overrides` (--dim), then the
/// model's defaults. A symbol bound to two sizes is an error naming both places.
pub fn bind_dims(
    g: &Graph,
    feeds: &HashMap<String, Tensor>,
    overrides: &BTreeMap<String, usize>,
) -> Result<BTreeMap<String, usize>> {
    let mut bound: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for (k, v) in overrides {
        bound.insert(k.clone(), (*v, format!("--dim {k}={v}")));
    }
    for i in &g.inputs {
        let Some(t) = feeds.get(&i.name) else {
            continue;
        };
        if t.shape().len() != i.shape.len() {
            crate::bail!(
                Input,
                "input '{}' must have rank {} (shape [{}]), got shape {}",
                i.name,
                i.shape.len(),
                i.shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                crate::tensor::fmt_shape(t.shape())
            );
        }
        for (k, (d, &n)) in i.shape.iter().zip(t.shape()).enumerate() {
            match d {
                Dim::Fixed(m) if *m != n => crate::bail!(
                    Input,
                    "input '{}' must have size {m} in dim {k}, got shape {}",
                    i.name,
                    crate::tensor::fmt_shape(t.shape())
                ),
                Dim::Sym(s) => {
                    let here = format!("input '{}' dim {k}", i.name);
                    match bound.get(s) {
                        Some((m, place)) if *m != n => crate::bail!(
                            Input,
                            "symbolic dim '{s}' is bound to {m} by {place} and to {n} by {here}"
                        ),
                        Some(_) => {}
                        None => {
                            bound.insert(s.clone(), (n, here));
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let mut out: BTreeMap<String, usize> = g.dims.clone();
    for (k, (v, _)) in bound {
        out.insert(k, v);
    }
    Ok(out)
}

/// The graph with every floating input, initializer, Constant and Cast target moved to
/// `dtype` (`--dtype f16|bf16`): storage in that dtype, f32 accumulation in kernels.
pub fn with_float_dtype(g: &Graph, dtype: DType) -> Graph {
    use crate::graph::{InitSource, Op};
    let mut g = g.clone();
    for i in &mut g.inputs {
        if i.dtype.is_float() {
            i.dtype = dtype;
        }
    }
    for init in &mut g.initializers {
        if init.tensor.dtype().is_float() && init.tensor.dtype() != dtype {
            init.tensor = init.tensor.cast(dtype);
            init.source = InitSource::Data;
        }
    }
    for n in &mut g.nodes {
        match &mut n.op {
            Op::Cast { to } if to.is_float() => *to = dtype,
            Op::Constant { value } if value.dtype().is_float() => *value = value.cast(dtype),
            _ => {}
        }
    }
    g
}
