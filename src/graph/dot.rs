//! Graphviz DOT output (`inspect --dot`). Fused nodes are drawn filled so that what the
//! passes did is visible at a glance.

use super::*;

pub fn to_dot(g: &Graph) -> String {
    let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
    let mut o = format!(
        "digraph \"{}\" {{\n  rankdir=TB;\n  node [shape=box, fontname=\"Helvetica\"];\n",
        esc(&g.name)
    );
    for i in &g.inputs {
        o.push_str(&format!(
            "  \"v:{}\" [label=\"{}\\n{} {:?}\", shape=ellipse];\n",
            esc(&i.name),
            esc(&i.name),
            i.dtype,
            i.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>()
        ));
    }
    let mut producer = std::collections::HashMap::new();
    for n in &g.nodes {
        for out in &n.outputs {
            producer.insert(out.as_str(), n.name.as_str());
        }
    }
    for n in &g.nodes {
        let fused = matches!(
            n.op,
            Op::FusedMatMul { .. } | Op::Attention { .. } | Op::VarlenAttention { .. }
        );
        let style = if fused {
            ", style=filled, fillcolor=\"#ffd27f\""
        } else {
            ""
        };
        o.push_str(&format!(
            "  \"n:{}\" [label=\"{}\\n{}\"{style}];\n",
            esc(&n.name),
            esc(&n.name),
            n.op.name()
        ));
        for inp in n.inputs.iter().filter(|s| !s.is_empty()) {
            match producer.get(inp.as_str()) {
                Some(p) => o.push_str(&format!(
                    "  \"n:{}\" -> \"n:{}\" [label=\"{}\"];\n",
                    esc(p),
                    esc(&n.name),
                    esc(inp)
                )),
                None if g.input(inp).is_some() => o.push_str(&format!(
                    "  \"v:{}\" -> \"n:{}\";\n",
                    esc(inp),
                    esc(&n.name)
                )),
                None => {} // initializers are left out to keep the picture readable
            }
        }
    }
    for out in &g.outputs {
        o.push_str(&format!(
            "  \"o:{}\" [label=\"{}\", shape=ellipse, style=bold];\n",
            esc(out),
            esc(out)
        ));
        if let Some(p) = producer.get(out.as_str()) {
            o.push_str(&format!("  \"n:{}\" -> \"o:{}\";\n", esc(p), esc(out)));
        }
    }
    o.push_str("}\n");
    o
}
