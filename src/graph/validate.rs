//! Structural validation: every value defined once, every use defined, arities right,
//! no cycles. Shapes are checked by inference (infer/) once dims are bound; `validate`
//! runs it already when the model's `dims:` defaults bind every symbol.

use super::*;
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet};

/// Where each value is defined, for messages; a value defined twice is an error naming
/// both places.
fn where_defined(g: &Graph) -> Result<HashMap<&str, String>> {
    let at =
        |l: &Option<crate::error::Loc>| l.as_ref().map(|l| format!(" at {l}")).unwrap_or_default();
    let defs = g
        .inputs
        .iter()
        .map(|i| (i.name.as_str(), format!("graph input{}", at(&i.loc))))
        .chain(
            g.initializers
                .iter()
                .map(|i| (i.name.as_str(), format!("initializer{}", at(&i.loc)))),
        )
        .chain(g.nodes.iter().flat_map(|n| {
            n.outputs
                .iter()
                .filter(|o| !o.is_empty())
                .map(move |o| (o.as_str(), format!("output of {}", n.describe())))
        }));
    let mut seen: HashMap<&str, String> = HashMap::new();
    let mut errs = vec![];
    for (name, what) in defs {
        match seen.get(name) {
            Some(prev) => errs.push(Error::Graph(format!(
                "value '{name}' is defined twice: as {prev} and as {what}"
            ))),
            None => {
                seen.insert(name, what);
            }
        }
    }
    match errs.len() {
        0 => Ok(seen),
        1 => Err(errs.pop().unwrap()),
        _ => Err(Error::Many(errs)),
    }
}

/// Checks names, uses, arities and acyclicity; then, when every symbolic dim has a
/// default, infers all shapes (evaluating shape arithmetic with `ev`) so that shape errors
/// surface at load time.
pub fn validate(g: &Graph, ev: &dyn HostEval) -> Result<()> {
    let defs = where_defined(g)?;
    let mut names = HashSet::new();
    for n in &g.nodes {
        if !names.insert(n.name.as_str()) {
            crate::bail!(
                Graph,
                "two nodes are named '{}'; node names must be unique ({})",
                n.name,
                n.describe()
            );
        }
        let (lo, hi, olo, ohi) = n.op.arity();
        if n.inputs.len() < lo || n.inputs.len() > hi {
            let want = if lo == hi {
                lo.to_string()
            } else if hi == usize::MAX {
                format!("at least {lo}")
            } else {
                format!("{lo} to {hi}")
            };
            crate::bail!(
                Graph,
                "{} takes {want} inputs, got {}",
                n.describe(),
                n.inputs.len()
            );
        }
        if n.outputs.len() < olo || n.outputs.len() > ohi {
            let want = if olo == ohi {
                olo.to_string()
            } else if ohi == usize::MAX {
                format!("at least {olo}")
            } else {
                format!("{olo} to {ohi}")
            };
            crate::bail!(
                Graph,
                "{} has {want} outputs, got {}",
                n.describe(),
                n.outputs.len()
            );
        }
        for (i, inp) in n.inputs.iter().enumerate() {
            if inp.is_empty() {
                if i < lo && !n.op.may_omit(i) {
                    crate::bail!(Graph, "{}: input {i} is required but omitted", n.describe());
                }
            } else if !defs.contains_key(inp.as_str()) {
                crate::bail!(
                    Graph,
                    "{}: input '{inp}' is not defined by any graph input, initializer or node",
                    n.describe()
                );
            }
        }
        // Gradient ops may leave any output unnamed (that gradient is not needed).
        if !n.op.is_grad() && n.outputs.first().is_some_and(|o| o.is_empty()) {
            crate::bail!(Graph, "{}: its first output must be named", n.describe());
        }
    }
    if g.outputs.is_empty() {
        crate::bail!(Graph, "the graph lists no outputs");
    }
    for o in &g.outputs {
        if !defs.contains_key(o.as_str()) {
            crate::bail!(
                Graph,
                "graph output '{o}' is not defined by any graph input, initializer or node"
            );
        }
    }
    if let Some(t) = &g.training {
        if !defs.contains_key(t.loss.as_str()) {
            crate::bail!(
                Graph,
                "training loss '{}' is not a value of the graph",
                t.loss
            );
        }
    }
    for (k, u) in g.updates.iter().enumerate() {
        let Some(init) = g.initializer(&u.target) else {
            crate::bail!(
                Graph,
                "updates: '{}' is not an initializer (a state update writes an initializer)",
                u.target
            );
        };
        if init.trainable {
            crate::bail!(
                Graph,
                "updates: initializer '{}' is trainable; a state update and a gradient step \
                 cannot both write it (mark it trainable: false)",
                u.target
            );
        }
        if !g.outputs.contains(&u.value) {
            crate::bail!(
                Graph,
                "updates: the value '{}' given for '{}' is not a graph output",
                u.value,
                u.target
            );
        }
        if g.updates[..k].iter().any(|p| p.target == u.target) {
            crate::bail!(Graph, "updates: '{}' is updated twice", u.target);
        }
    }
    topo_order(g)?;
    // With every symbol bound by a default, check all shapes now (unless some depend on
    // input values, which only a run gives).
    let syms = g.symbols();
    if syms.iter().all(|s| g.dims.contains_key(s)) && infer::plan_time_inputs(g).is_empty() {
        let shapes = g
            .inputs
            .iter()
            .map(|i| {
                let s = i.shape.iter().map(|d| match d {
                    Dim::Fixed(n) => *n,
                    Dim::Sym(s) => g.dims[s],
                });
                (i.name.clone(), s.collect())
            })
            .collect();
        let inf = match infer::infer_graph(g, &shapes, ev) {
            Ok(inf) => inf,
            // A shape decided by a value computed inside the graph: a run finds it.
            Err(_) if infer::first_blocked(g, &shapes, &Default::default(), ev)?.is_some() => {
                return Ok(())
            }
            Err(e) => return Err(e),
        };
        for u in &g.updates {
            let (want, got) = (&inf.types[&u.target], &inf.types[&u.value]);
            if want != got {
                crate::bail!(
                    Graph,
                    "updates: '{}' is {want} but its update '{}' is {got}",
                    u.target,
                    u.value
                );
            }
        }
    }
    Ok(())
}

/// A topological order of the nodes (stable: ties keep file order). A cycle is an error
/// naming the nodes on it.
pub fn topo_order(g: &Graph) -> Result<Vec<usize>> {
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        for o in &n.outputs {
            if !o.is_empty() {
                producer.insert(o, i);
            }
        }
    }
    let n = g.nodes.len();
    let mut indeg = vec![0usize; n];
    let mut users: Vec<Vec<usize>> = vec![vec![]; n];
    for (i, node) in g.nodes.iter().enumerate() {
        let mut seen = HashSet::new();
        for inp in &node.inputs {
            if let Some(&p) = producer.get(inp.as_str()) {
                if seen.insert(p) {
                    indeg[i] += 1;
                    users[p].push(i);
                }
            }
        }
    }
    // Kahn's algorithm with a min-heap on the file index keeps the order stable.
    let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<usize>> = (0..n)
        .filter(|&i| indeg[i] == 0)
        .map(std::cmp::Reverse)
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(std::cmp::Reverse(i)) = ready.pop() {
        order.push(i);
        for &u in &users[i] {
            indeg[u] -= 1;
            if indeg[u] == 0 {
                ready.push(std::cmp::Reverse(u));
            }
        }
    }
    if order.len() < n {
        // Walk back from a stuck node to find and name one cycle.
        let stuck: HashSet<usize> = (0..n).filter(|&i| indeg[i] > 0).collect();
        let mut path = vec![*stuck.iter().min().unwrap()];
        loop {
            let cur = *path.last().unwrap();
            let next = g.nodes[cur]
                .inputs
                .iter()
                .filter_map(|i| producer.get(i.as_str()).copied())
                .find(|p| stuck.contains(p))
                .unwrap();
            if let Some(pos) = path.iter().position(|&p| p == next) {
                let mut cyc: Vec<String> = path[pos..]
                    .iter()
                    .rev()
                    .map(|&i| format!("'{}'", g.nodes[i].name))
                    .collect();
                cyc.push(cyc[0].clone());
                crate::bail!(Graph, "the graph has a cycle: {}", cyc.join(" -> "));
            }
            path.push(next);
        }
    }
    Ok(order)
}
