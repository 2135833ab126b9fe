//! Graphviz DOT output (`inspect --dot`). Fused nodes are drawn filled and say what they
//! absorbed, so that what the passes did is visible at a glance; edges carry the value's
//! name and type. Every text that comes from the model goes through `quote`, so any name
//! (quotes, backslashes, newlines) gives a file `dot` reads.

use super::infer::symbolic::SymType;
use super::*;
use std::collections::HashMap;

/// `s` as a DOT double-quoted string. Inside one, `"` must be escaped, and a backslash
/// starts one of Graphviz's label escapes (`\n`, `\l`, `\N`, ...), so a literal one is
/// doubled; a line break in `s` becomes the `\n` escape (centered line).
pub fn quote(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\r' => {}
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Whether the passes made this node out of several (drawn filled).
pub fn is_fused(op: &Op) -> bool {
    matches!(
        op,
        Op::FusedMatMul { .. }
            | Op::GatedMatMul { .. }
            | Op::GatedMatMulGrad { .. }
            | Op::FusedConv { .. }
            | Op::Attention { .. }
            | Op::VarlenAttention { .. }
            | Op::FusedMatMulGrad { .. }
            | Op::AttentionGrad { .. }
            | Op::VarlenAttentionGrad { .. }
            | Op::Reduce {
                kind: ReduceKind::MeanSquare,
                ..
            }
    )
}

/// What a fused node does beyond its core op, from its attributes and which optional
/// inputs and outputs it has: e.g. `bias, gelu, residual` for a FusedMatMul. None for a
/// node that is not fused.
pub fn absorbed(n: &Node) -> Option<String> {
    let has = |i: usize| n.inputs.get(i).is_some_and(|s| !s.is_empty());
    let out = |i: usize| n.outputs.get(i).is_some_and(|s| !s.is_empty());
    let scale = |s: &Option<f32>| match s {
        Some(s) => format!("scale {s}"),
        None => "scale 1/sqrt(D)".to_string(),
    };
    let mut v: Vec<String> = vec![];
    match &n.op {
        Op::FusedMatMul {
            activation,
            trans_b,
        } => {
            if *trans_b {
                v.push("B transposed".into());
            }
            if has(2) {
                v.push("bias".into());
            }
            if *activation != Activation::None {
                v.push(activation.name().into());
            }
            if has(3) {
                v.push("residual".into());
            }
            if out(1) {
                v.push("keeps pre-activation".into());
            }
        }
        Op::GatedMatMul {
            activation,
            trans_b,
        } => {
            v.push(format!("{} gate × up projection", activation.name()));
            if *trans_b {
                v.push("B transposed".into());
            }
            if has(3) || has(4) {
                v.push("bias".into());
            }
            if out(1) || out(2) {
                v.push("keeps both products".into());
            }
        }
        Op::FusedConv { activation, .. } => {
            if has(2) {
                v.push("bias".into());
            }
            if has(3) {
                v.push("residual".into());
            }
            if *activation != Activation::None {
                v.push(activation.name().into());
            }
            if out(1) {
                v.push("keeps pre-activation".into());
            }
        }
        Op::Attention {
            is_causal,
            scale: s,
            q_num_heads,
            kv_num_heads,
        } => {
            v.push(scale(s));
            if *is_causal {
                v.push("causal".into());
            }
            if has(3) {
                v.push("mask".into());
            }
            v.push("softmax".into());
            if !has(1) && !has(2) {
                v.push("packed QKV".into());
            }
            match (q_num_heads, kv_num_heads) {
                (Some(q), Some(k)) if q != k => v.push(format!("{q} heads, {k} K/V heads")),
                (Some(q), _) => v.push(format!("{q} heads")),
                _ => {}
            }
            if out(1) {
                v.push("keeps logsumexp".into());
            }
        }
        Op::VarlenAttention {
            is_causal,
            scale: s,
        } => {
            v.push("packed sequences".into());
            v.push(scale(s));
            if *is_causal {
                v.push("causal".into());
            }
            if out(1) {
                v.push("keeps logsumexp".into());
            }
        }
        Op::Reduce {
            kind: ReduceKind::MeanSquare,
            ..
        } => v.push("square (Mul), ReduceMean".into()),
        Op::GatedMatMulGrad { activation, .. } => {
            v.push(format!("{}' and the product: dG, dU", activation.name()));
        }
        Op::FusedMatMulGrad {
            activation,
            trans_b,
            a_activation,
        } => {
            if *activation != Activation::None {
                v.push(format!("{}'", activation.name()));
            }
            v.push("dA, dB".into());
            if *trans_b {
                v.push("B transposed".into());
            }
            if out(2) {
                v.push("dBias".into());
            }
            if *a_activation != Activation::None {
                v.push(format!("{}' of A's producer", a_activation.name()));
            }
            if out(3) {
                v.push("its dBias".into());
            }
        }
        Op::AttentionGrad {
            is_causal,
            scale: s,
            ..
        }
        | Op::VarlenAttentionGrad {
            is_causal,
            scale: s,
        } => {
            v.push("dQ, dK, dV from logsumexp".into());
            v.push(scale(s));
            if *is_causal {
                v.push("causal".into());
            }
        }
        _ => return None,
    }
    Some(v.join(", "))
}

/// The graph as DOT. `types` gives each value's type for the edge labels (from
/// `infer::symbolic`, so symbols not bound stay symbols); values without one are
/// labelled by name alone.
pub fn to_dot(g: &Graph, types: &HashMap<String, SymType>) -> String {
    let q = quote;
    let ty = |v: &str| types.get(v).map(|t| t.to_string());
    let named = |v: &str| match ty(v) {
        Some(t) => format!("{v}\n{t}"),
        None => v.to_string(),
    };
    let mut o = format!(
        "digraph {} {{\n  rankdir=TB;\n  node [shape=box, fontname=\"Helvetica\"];\n  edge [fontname=\"Helvetica\", fontsize=10];\n",
        q(&g.name)
    );
    for i in &g.inputs {
        let declared: Vec<String> = i.shape.iter().map(|d| d.to_string()).collect();
        let t = ty(&i.name).unwrap_or_else(|| format!("{}[{}]", i.dtype, declared.join(", ")));
        o.push_str(&format!(
            "  {} [label={}, shape=ellipse];\n",
            q(&format!("v:{}", i.name)),
            q(&format!("{}\n{t}", i.name))
        ));
    }
    let mut producer = HashMap::new();
    for n in &g.nodes {
        for out in n.outputs.iter().filter(|s| !s.is_empty()) {
            producer.insert(out.as_str(), n.name.as_str());
        }
    }
    for n in &g.nodes {
        let id = q(&format!("n:{}", n.name));
        let mut label = format!("{}\n{}", n.name, n.op.name());
        if let Some(what) = absorbed(n) {
            label.push_str(&format!("\n({what})"));
        }
        let style = if is_fused(&n.op) {
            ", style=filled, fillcolor=\"#ffd27f\""
        } else {
            ""
        };
        o.push_str(&format!("  {id} [label={}{style}];\n", q(&label)));
        for inp in n.inputs.iter().filter(|s| !s.is_empty()) {
            match producer.get(inp.as_str()) {
                Some(p) => o.push_str(&format!(
                    "  {} -> {id} [label={}];\n",
                    q(&format!("n:{p}")),
                    q(&named(inp))
                )),
                None if g.input(inp).is_some() => {
                    o.push_str(&format!("  {} -> {id};\n", q(&format!("v:{inp}"))))
                }
                None => {} // initializers are left out to keep the picture readable
            }
        }
    }
    for out in &g.outputs {
        let id = q(&format!("o:{out}"));
        o.push_str(&format!(
            "  {id} [label={}, shape=ellipse, style=bold];\n",
            q(&named(out))
        ));
        if let Some(p) = producer.get(out.as_str()) {
            o.push_str(&format!("  {} -> {id};\n", q(&format!("n:{p}"))));
        } else if g.input(out).is_some() {
            o.push_str(&format!("  {} -> {id};\n", q(&format!("v:{out}"))));
        }
    }
    o.push_str("}\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quote_escapes_what_dot_would_misread() {
        assert_eq!(quote("plain"), "\"plain\"");
        assert_eq!(quote("a\"b"), "\"a\\\"b\"");
        // A trailing backslash must not escape the closing quote.
        assert_eq!(quote("a\\"), "\"a\\\\\"");
        assert_eq!(quote("x\nf32[\"batch\"]"), "\"x\\nf32[\\\"batch\\\"]\"");
    }
}
