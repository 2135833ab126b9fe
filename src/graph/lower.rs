//! ONNX operators that graphrun has no op of its own for (Conv and the pools, Resize,
//! BatchNormalization, Tile, Einsum, the variadic Sum, …) are written as compositions of
//! graphrun's ops by the ONNX importer. A YAML model may name them as an `.onnx` file does:
//! the loader keeps each such node aside (`ForeignNode`) and hands it, with what is known
//! of its inputs, to a `Lower`. The crate passes the importer's in; the IR itself imports
//! nothing above it.

use super::infer::{symbolic::PRIMES, Inferred};
use super::op::Attr;
use super::{Dim, Graph, HostEval, Node};
use crate::error::{Error, Loc, Result};
use crate::tensor::{DType, Tensor};
use std::collections::{HashMap, HashSet};

/// A node whose op is an ONNX operator that only a `Lower` can write.
#[derive(Clone, Debug)]
pub struct ForeignNode {
    /// Its position among the model's nodes (for `#index` in messages when unnamed).
    pub index: usize,
    /// The node's name as written ("" when unnamed).
    pub name: String,
    /// The ONNX op name.
    pub op: String,
    /// Its attributes as written (untyped: the lowering reads them).
    pub attrs: Vec<Attr>,
    /// Input value names; "" marks an omitted optional input.
    pub inputs: Vec<String>,
    /// Output value names.
    pub outputs: Vec<String>,
    /// Where it was written in the model file, for error messages.
    pub loc: Option<Loc>,
}

/// What is known of a value when a node reading it is lowered.
#[derive(Clone, Debug)]
pub struct Known {
    /// The value's element type.
    pub dtype: DType,
    /// One entry per axis; `None` where the size depends on a symbolic dim.
    pub dims: Vec<Option<usize>>,
    /// The value itself, when it is small and known on the host whatever the symbols.
    pub value: Option<Tensor>,
}

/// Writes foreign nodes as graphrun's ops.
pub trait Lower {
    /// Whether a node of ONNX op `op` with `inputs` inputs is written by this lowering
    /// rather than parsed as one of graphrun's ops.
    fn lowers(&self, op: &str, inputs: usize) -> bool;
    /// graphrun's nodes computing `node`'s outputs. `known` holds what is known of the
    /// values so far; new value names are taken from (and added to) `taken`.
    fn lower(
        &self,
        node: &ForeignNode,
        known: &HashMap<String, Known>,
        taken: &mut HashSet<String>,
    ) -> Result<Vec<Node>>;
    /// As `lower`, where what it writes may hold foreign nodes of its own (those of an
    /// inlined control-flow body), lowered in turn once what they read is known.
    fn lower_nested(
        &self,
        node: &ForeignNode,
        known: &HashMap<String, Known>,
        taken: &mut HashSet<String>,
    ) -> Result<(Vec<Node>, Vec<ForeignNode>)> {
        Ok((self.lower(node, known, taken)?, vec![]))
    }
}

/// No lowering: every op must be one of graphrun's.
pub struct NoLower;

impl Lower for NoLower {
    fn lowers(&self, _: &str, _: usize) -> bool {
        false
    }
    fn lower(
        &self,
        n: &ForeignNode,
        _: &HashMap<String, Known>,
        _: &mut HashSet<String>,
    ) -> Result<Vec<Node>> {
        Err(Error::Graph(format!(
            "node '{}': unknown op '{}'",
            n.name, n.op
        )))
    }
}

enum Item {
    Native(usize),
    Foreign(usize),
}

/// Adds the lowered form of every foreign node to `g`. The nodes are visited in an
/// execution order while types are inferred twice, with the unbound symbols at two sets
/// of sizes, so that a lowering sees each input's dtype and rank and the dims that hold
/// whatever the symbols are (as an `.onnx` file's declared shapes would give them).
/// Every node's problems are reported together.
pub fn lower_all(
    g: &mut Graph,
    foreign: &[ForeignNode],
    lower: &dyn Lower,
    ev: &dyn HostEval,
) -> Result<()> {
    let mut taken: HashSet<String> = g.inputs.iter().map(|i| i.name.clone()).collect();
    taken.extend(g.initializers.iter().map(|i| i.name.clone()));
    taken.extend(g.nodes.iter().flat_map(|n| n.outputs.iter().cloned()));
    taken.extend(foreign.iter().flat_map(|n| n.outputs.iter().cloned()));
    let mut cx = Lowering {
        lower,
        ev,
        taken,
        runs: start_runs(g),
        // A value that training changes is not a constant of the model.
        trainable: g
            .initializers
            .iter()
            .filter(|i| g.varies(i))
            .map(|i| i.name.clone())
            .collect(),
        errors: vec![],
    };
    let natives = g.nodes.clone();
    cx.visit(g, &natives, false, foreign);
    match cx.errors.len() {
        0 => Ok(()),
        1 => Err(cx.errors.remove(0)),
        _ => Err(Error::Many(cx.errors)),
    }
}

/// The state of `lower_all`.
struct Lowering<'a> {
    lower: &'a dyn Lower,
    ev: &'a dyn HostEval,
    taken: HashSet<String>,
    runs: [Option<Inferred>; 2],
    trainable: HashSet<String>,
    errors: Vec<Error>,
}

impl Lowering<'_> {
    /// Visits `natives` and `foreign` in an execution order, adding the natives to `g`
    /// where `add` says (they are not there yet) and the lowered form of each foreign
    /// node, and inferring types as it goes.
    fn visit(&mut self, g: &mut Graph, natives: &[Node], add: bool, foreign: &[ForeignNode]) {
        for item in execution_order(natives, foreign) {
            let nodes = match item {
                Item::Native(i) => {
                    if add {
                        g.nodes.push(natives[i].clone());
                    }
                    vec![natives[i].clone()]
                }
                Item::Foreign(k) => {
                    let f = &foreign[k];
                    let known = known_inputs(f, &self.runs, &self.trainable);
                    match self.lower.lower_nested(f, &known, &mut self.taken) {
                        Ok((mut nodes, mut more)) => {
                            for n in &mut nodes {
                                n.loc = n.loc.take().or_else(|| f.loc.clone());
                            }
                            if !more.is_empty() {
                                for m in &mut more {
                                    m.loc = m.loc.take().or_else(|| f.loc.clone());
                                }
                                self.visit(g, &nodes, true, &more);
                                continue;
                            }
                            g.nodes.extend(nodes.iter().cloned());
                            nodes
                        }
                        Err(e) => {
                            self.errors.push(match (&f.loc, e) {
                                (Some(loc), Error::Graph(m)) => Error::model(loc, m),
                                (_, e) => e,
                            });
                            continue;
                        }
                    }
                }
            };
            // A node inference refuses leaves its outputs unknown; validation reports it.
            for run in self.runs.iter_mut().flatten() {
                for n in &nodes {
                    let _ = run.step(n, self.ev);
                }
            }
        }
    }
}

/// Every node, native and foreign, producers before readers; nodes on a cycle or reading
/// undefined values come last in their listed order (validation names the fault).
fn execution_order(natives: &[Node], foreign: &[ForeignNode]) -> Vec<Item> {
    let items: Vec<(&[String], &[String])> = natives
        .iter()
        .map(|n| (n.inputs.as_slice(), n.outputs.as_slice()))
        .chain(
            foreign
                .iter()
                .map(|n| (n.inputs.as_slice(), n.outputs.as_slice())),
        )
        .collect();
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, (_, outs)) in items.iter().enumerate() {
        for o in outs.iter().filter(|o| !o.is_empty()) {
            producer.entry(o.as_str()).or_insert(i);
        }
    }
    let mut waiting = vec![0usize; items.len()];
    let mut readers: Vec<Vec<usize>> = vec![vec![]; items.len()];
    for (i, (ins, _)) in items.iter().enumerate() {
        for p in ins.iter().filter_map(|v| producer.get(v.as_str())) {
            waiting[i] += 1;
            readers[*p].push(i);
        }
    }
    let mut ready: Vec<usize> = (0..items.len())
        .rev()
        .filter(|&i| waiting[i] == 0)
        .collect();
    let mut done = vec![false; items.len()];
    let mut order = vec![];
    while let Some(i) = ready.pop() {
        done[i] = true;
        order.push(i);
        for &r in readers[i].iter().rev() {
            waiting[r] -= 1;
            if waiting[r] == 0 {
                ready.push(r);
            }
        }
    }
    order.extend((0..items.len()).filter(|&i| !done[i]));
    let native = natives.len();
    order
        .into_iter()
        .map(|i| {
            if i < native {
                Item::Native(i)
            } else {
                Item::Foreign(i - native)
            }
        })
        .collect()
}

/// Two inference runs with the graph's symbols at different sizes; none when the graph
/// has more symbols than there are sizes to give them (then only the initializers are
/// known, from the graph itself).
fn start_runs(g: &Graph) -> [Option<Inferred>; 2] {
    let symbols = g.symbols();
    let empty = HashMap::new();
    let run = |primes: &[usize]| -> Option<Inferred> {
        if symbols.len() > primes.len() {
            return None;
        }
        let shapes = g
            .inputs
            .iter()
            .map(|i| {
                let dims = i.shape.iter().map(|d| match d {
                    Dim::Fixed(n) => *n,
                    Dim::Sym(s) => primes[symbols.iter().position(|x| x == s).unwrap_or(0)],
                });
                (i.name.clone(), dims.collect())
            })
            .collect();
        Inferred::start(g, &shapes, &empty).ok()
    };
    [run(&PRIMES[0]), run(&PRIMES[1])]
}

/// What both runs agree on about each input of `f`.
fn known_inputs(
    f: &ForeignNode,
    runs: &[Option<Inferred>; 2],
    trainable: &HashSet<String>,
) -> HashMap<String, Known> {
    let mut out = HashMap::new();
    let [Some(a), Some(b)] = runs else {
        return out;
    };
    for v in f.inputs.iter().filter(|v| !v.is_empty()) {
        let (Some(ta), Some(tb)) = (a.types.get(v), b.types.get(v)) else {
            continue;
        };
        if ta.dtype != tb.dtype || ta.shape.len() != tb.shape.len() {
            continue;
        }
        let dims = ta
            .shape
            .iter()
            .zip(&tb.shape)
            .map(|(&x, &y)| (x == y).then_some(x))
            .collect();
        let value = match (a.consts.get(v), b.consts.get(v)) {
            _ if trainable.contains(v) => None,
            (Some(x), Some(y)) if x.shape() == y.shape() && x.to_f64_vec() == y.to_f64_vec() => {
                Some(x.clone())
            }
            _ => None,
        };
        out.insert(
            v.clone(),
            Known {
                dtype: ta.dtype,
                dims,
                value,
            },
        );
    }
    out
}
