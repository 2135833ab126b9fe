//! Graphs whose shapes depend on values computed inside them: a detection head's NonZero
//! of thresholded scores or NonMaxSuppression of its boxes, a Reshape to a size read from
//! data. A plan needs every shape, so such a graph runs in stages: the part a blocked node
//! depends on is planned and run alone, its results become Constants, and the blocked
//! node is computed on the host from them (NonZero, Unique, NonMaxSuppression) or now has
//! its shape-deciding inputs known; then the rest is planned again, until nothing is
//! blocked. Every node runs once; only the values that cross a cut go through the host.

use crate::error::{Error, Result};
use crate::graph::eval::{HostEval, PLAN_INPUT_LIMIT};
use crate::graph::infer;
pub use crate::graph::infer::{first_blocked, Blocked};
use crate::graph::{Graph, Node, Op};
use crate::tensor::Tensor;
use std::collections::{HashMap, HashSet};

/// The values of the plan-time inputs of `g` small enough to plan for (the rest decide
/// what they decide in a stage of their own).
pub fn small_plan_values(g: &Graph, feeds: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    infer::plan_time_inputs(g)
        .into_iter()
        .filter_map(|p| {
            let t = feeds.get(&p.name)?;
            (t.numel() <= PLAN_INPUT_LIMIT).then(|| (p.name, t.clone()))
        })
        .collect()
}

/// The part of a graph that runs before a blocked node.
pub struct Stage {
    /// The nodes the blocked node depends on, as a graph whose outputs are the values of
    /// theirs that the rest reads (or that are the whole graph's outputs).
    pub graph: Graph,
    /// Their indices in the whole graph.
    nodes: HashSet<usize>,
}

/// The stage before blocked node `ni` of `g`.
pub fn stage_before(g: &Graph, ni: usize) -> Stage {
    let producer = g.producers();
    let mut before: HashSet<usize> = HashSet::new();
    let mut stack: Vec<usize> = g.nodes[ni]
        .inputs
        .iter()
        .filter_map(|v| producer.get(v.as_str()).copied())
        .collect();
    while let Some(p) = stack.pop() {
        if before.insert(p) {
            stack.extend(
                g.nodes[p]
                    .inputs
                    .iter()
                    .filter_map(|v| producer.get(v.as_str()).copied()),
            );
        }
    }
    let read_after: HashSet<&str> = g
        .nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| !before.contains(i))
        .flat_map(|(_, n)| n.inputs.iter().map(String::as_str))
        .chain(g.outputs.iter().map(String::as_str))
        .collect();
    let nodes: Vec<Node> = (0..g.nodes.len())
        .filter(|i| before.contains(i))
        .map(|i| g.nodes[i].clone())
        .collect();
    let mut outputs: Vec<String> = vec![];
    for o in nodes.iter().flat_map(|n| &n.outputs) {
        if !o.is_empty() && read_after.contains(o.as_str()) && !outputs.contains(o) {
            outputs.push(o.clone());
        }
    }
    let graph = Graph {
        nodes,
        outputs,
        training: None,
        updates: vec![],
        ..g.clone()
    };
    Stage {
        graph,
        nodes: before,
    }
}

/// `g` after the stage `stage` ran and gave `values` (its outputs, in order): its nodes
/// replaced by Constants of those values, and blocked node `ni`, when it is NonZero,
/// Unique or NonMaxSuppression, by Constants of its outputs computed on the host. Errors
/// with `why` (inference's error at `ni`) when that would leave `ni` as blocked as before
/// (what blocks it is a graph input or a Constant too large to read on the host).
pub fn after_stage(
    g: &Graph,
    ni: usize,
    stage: &Stage,
    values: Vec<Tensor>,
    feeds: &HashMap<String, Tensor>,
    ev: &dyn HostEval,
    why: Error,
) -> Result<Graph> {
    let known: HashMap<&str, &Tensor> = stage
        .graph
        .outputs
        .iter()
        .map(String::as_str)
        .zip(&values)
        .chain(feeds.iter().map(|(k, v)| (k.as_str(), v)))
        .chain(g.initializers.iter().map(|i| (i.name.as_str(), &i.tensor)))
        .collect();
    let blocked = &g.nodes[ni];
    let on_host = matches!(
        blocked.op,
        Op::NonZero | Op::Unique { .. } | Op::NonMaxSuppression { .. }
    );
    // A stage of Constants alone (or none) would leave the node as blocked as it is.
    let computes = stage
        .nodes
        .iter()
        .any(|&i| !matches!(g.nodes[i].op, Op::Constant { .. }));
    if !computes && !on_host {
        return Err(why);
    }
    let constant = |name: &str, t: Tensor| Node {
        name: format!("{name}/staged"),
        op: Op::Constant { value: t },
        inputs: vec![],
        outputs: vec![name.to_string()],
        loc: blocked.loc.clone(),
    };
    let mut nodes: Vec<Node> = stage
        .graph
        .outputs
        .iter()
        .zip(values.iter().cloned())
        .map(|(v, t)| constant(v, t))
        .collect();
    if on_host {
        let mut args = vec![];
        for v in &blocked.inputs {
            args.push(match v.as_str() {
                "" => None,
                v => Some(*known.get(v).ok_or_else(|| {
                    crate::err!(
                        Graph,
                        "{}: input '{v}' is not known after its stage",
                        blocked.describe()
                    )
                })?),
            });
        }
        let outs = ev
            .eval_data_shaped(&blocked.op, &args)
            .map_err(|m| crate::err!(Graph, "{}: {m}", blocked.describe()))?;
        for (o, t) in blocked.outputs.iter().zip(outs) {
            if !o.is_empty() {
                nodes.push(constant(o, t));
            }
        }
    }
    nodes.extend(
        g.nodes
            .iter()
            .enumerate()
            .filter(|&(i, _)| !(stage.nodes.contains(&i) || on_host && i == ni))
            .map(|(_, n)| n.clone()),
    );
    Ok(Graph { nodes, ..g.clone() })
}
