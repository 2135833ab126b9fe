//! Dead-node elimination: keeps what the graph outputs (and the training loss) need,
//! walking back from them; every other node and every unused initializer goes.
//! Graph inputs are the model's interface and always stay.

use super::PassState;
use crate::error::Result;
use crate::graph::{validate, Graph};
use std::collections::HashSet;

pub(crate) fn run(mut g: Graph, st: &mut PassState) -> Result<Graph> {
    let mut live: HashSet<String> = g.outputs.iter().cloned().collect();
    live.extend(g.training.as_ref().map(|t| t.loss.clone()));
    let order = validate::topo_order(&g)?;
    let mut keep = vec![false; g.nodes.len()];
    for &i in order.iter().rev() {
        let n = &g.nodes[i];
        if n.outputs.iter().any(|o| live.contains(o)) {
            keep[i] = true;
            live.extend(n.inputs.iter().filter(|v| !v.is_empty()).cloned());
        }
    }
    let nodes = std::mem::take(&mut g.nodes);
    for (n, k) in nodes.into_iter().zip(keep) {
        if k {
            g.nodes.push(n);
        } else {
            st.fired("dead_node", &n.name);
        }
    }
    let inits = std::mem::take(&mut g.initializers);
    for i in inits {
        if live.contains(&i.name) {
            g.initializers.push(i);
        } else {
            st.fired("unused_initializer", &i.name);
        }
    }
    Ok(g)
}
