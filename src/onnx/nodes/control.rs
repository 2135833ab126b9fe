//! If, Loop and Scan: control flow written as straight-line graphrun ops. graphrun's
//! graphs have no control flow, so each body is inlined: a Scan once per step of its
//! sequence, a Loop once per iteration, an If's branch once. The decisions are made when
//! the model is loaded, after shape inference (`graph::lower::lower_all`), from what is
//! known there: a sequence length from the scan inputs' shapes, a trip count or a
//! condition that the model computes from constants and shapes.
//!
//! Where the model leaves a decision to values fed at run time, the form written still
//! gives ONNX's results where it can: an If whose condition is fed runs both branches and
//! selects with `Where` (its branches must give outputs of one shape), and a Loop whose
//! condition is computed runs its known trip count with every loop-carried value frozen
//! (`Where`) once the condition turns false. A trip count fed at run time, or scan outputs
//! of a Loop that may stop early, have no such form: those are refused by name.
//!
//! Each body node is converted as a node of the model (`Importer::node`), its values
//! renamed per copy; values of the enclosing graph that a body reads stay as they are.
//! The enclosing node lists them as extra inputs (`IMPLICIT` counts them) so that they are
//! known, and computed, before it is inlined.

use super::composite::{bin, unsqueeze, Attrs};
use super::recurrent::MAX_STEPS;
use super::{take, Importer};
use crate::error::{Error, Result};
use crate::graph::op::{Attr, AttrValue};
use crate::graph::{BinaryOp, Op};
use crate::onnx::proto::{GraphProto, NodeProto};
use crate::tensor::{DType, Tensor};
use std::collections::{HashMap, HashSet};

/// The control-flow ops, written after shape inference.
pub(super) const CONTROL: &[&str] = &["If", "Loop", "Scan"];

/// ai.onnx.preview's FlexAttention, whose score and probability modifiers are graphs
/// (written out by `Importer::flex_attention`).
pub(super) fn is_flex(n: &NodeProto) -> bool {
    n.domain == "ai.onnx.preview" && n.op_type == "FlexAttention"
}

/// The most values a model may have once its control flow is written out: a loop nested
/// in a loop multiplies their iterations, and a model file could otherwise ask for any
/// number of copies.
pub(super) const MAX_VALUES: usize = 1_000_000;

/// The attribute that counts the outer values a control-flow node's bodies read, which the
/// importer appends to its inputs.
pub(super) const IMPLICIT: &str = "graphrun.implicit_inputs";

/// The values a graph reads from the graphs around it: read by its nodes (or their own
/// subgraphs) or given as its outputs, and defined neither as its inputs, its initializers
/// nor its nodes' outputs. In first-read order.
pub(super) fn free_values(g: &GraphProto) -> Vec<String> {
    let mut local: HashSet<&str> = g.input.iter().map(|v| v.name.as_str()).collect();
    local.extend(g.initializer.iter().map(|t| t.name.as_str()));
    local.extend(
        g.node
            .iter()
            .flat_map(|n| n.output.iter().map(String::as_str)),
    );
    let mut seen = HashSet::new();
    let mut out = vec![];
    let mut add = |v: &str| {
        if !v.is_empty() && !local.contains(v) && seen.insert(v.to_string()) {
            out.push(v.to_string());
        }
    };
    for n in &g.node {
        for i in &n.input {
            add(i);
        }
        for sub in subgraphs(n) {
            for v in free_values(sub) {
                add(&v);
            }
        }
    }
    for o in &g.output {
        add(&o.name);
    }
    out
}

/// The graphs a node holds as attributes.
pub(super) fn subgraphs(n: &NodeProto) -> impl Iterator<Item = &GraphProto> {
    n.attribute
        .iter()
        .flat_map(|a| a.g.as_deref().into_iter().chain(a.graphs.iter()))
}

/// Renames the values `g` reads from the graphs around it as `map` says (a copy of a body
/// renames its own values; a graph nested in it reads them under the new names).
fn rename_free(g: &mut GraphProto, map: &HashMap<String, String>) {
    let mut local: HashSet<String> = g.input.iter().map(|v| v.name.clone()).collect();
    local.extend(g.initializer.iter().map(|t| t.name.clone()));
    local.extend(g.node.iter().flat_map(|n| n.output.iter().cloned()));
    let outer: HashMap<String, String> = map
        .iter()
        .filter(|(k, _)| !local.contains(*k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let rename = |v: &mut String| {
        if let Some(r) = outer.get(v.as_str()) {
            *v = r.clone();
        }
    };
    for n in &mut g.node {
        n.input.iter_mut().for_each(rename);
        for a in &mut n.attribute {
            if let Some(sub) = a.g.as_deref_mut() {
                rename_free(sub, &outer);
            }
            for sub in &mut a.graphs {
                rename_free(sub, &outer);
            }
        }
    }
    for o in &mut g.output {
        rename(&mut o.name);
    }
}

impl Importer<'_> {
    /// The attributes of a control-flow node as it is kept aside: each graph an index
    /// into `graphs`, and `IMPLICIT` counting the outer values its graphs read, which are
    /// appended to `inputs`. Ops its graphs use that graphrun lacks are recorded with the
    /// model's.
    pub(super) fn control_attrs(
        &mut self,
        n: &NodeProto,
        shown: &str,
        inputs: &mut Vec<String>,
    ) -> Result<Vec<Attr>> {
        let what = format!("node '{shown}' ({})", n.op_type);
        let mut attrs = vec![];
        let mut free = vec![];
        for a in &n.attribute {
            let value = match (a.g.as_deref(), a.graphs.is_empty()) {
                (Some(g), true) => {
                    self.lacked_in(g, shown);
                    free.extend(free_values(g));
                    self.graphs.push(g.clone());
                    AttrValue::Int(self.graphs.len() as i64 - 1)
                }
                (None, true) => super::attr_value(a, self.base, &what)?,
                _ => {
                    return Err(Error::Graph(format!(
                        "{what}: attribute '{}' is a list of graphs, which {} does not take",
                        a.name, n.op_type
                    )))
                }
            };
            attrs.push(Attr {
                name: a.name.clone(),
                value,
                loc: None,
            });
        }
        let mut seen = HashSet::new();
        free.retain(|v| seen.insert(v.clone()));
        attrs.push(Attr {
            name: IMPLICIT.into(),
            value: AttrValue::Int(free.len() as i64),
            loc: None,
        });
        inputs.extend(free);
        Ok(attrs)
    }

    /// Whether control-flow node `n` reads a sequence (as an input, or in its bodies from
    /// the graph around them) or its bodies take or give one.
    pub(super) fn carries_sequences(&self, n: &NodeProto) -> bool {
        let is_seq = |v: &crate::onnx::proto::ValueInfoProto| {
            v.r#type.as_ref().is_some_and(|t| t.sequence_of().is_some())
        };
        // An untyped body output is a sequence where a sequence op writes it.
        let makes_seq = |g: &GraphProto| {
            g.node.iter().any(|b| {
                super::sequence::MAKES_SEQUENCE.contains(&b.op_type.as_str())
                    && b.output
                        .iter()
                        .any(|o| g.output.iter().any(|v| &v.name == o))
            })
        };
        n.input.iter().any(|i| self.seqs.contains_key(i))
            || subgraphs(n).any(|g| {
                g.input.iter().chain(&g.output).any(is_seq)
                    || makes_seq(g)
                    || free_values(g).iter().any(|v| self.seqs.contains_key(v))
            })
    }

    /// Records the ops of `g` (and of the graphs in it) that graphrun lacks.
    fn lacked_in(&mut self, g: &GraphProto, parent: &str) {
        for (k, n) in g.node.iter().enumerate() {
            let shown = if n.name.is_empty() {
                format!("{parent}/#{k}")
            } else {
                format!("{parent}/{}", n.name)
            };
            if let Some(key) = super::lacked(n) {
                self.unsupported.entry(key).or_default().push(shown.clone());
            }
            for sub in subgraphs(n) {
                self.lacked_in(sub, &shown);
            }
        }
    }

    /// Writes If, Loop or Scan.
    pub(super) fn lower_control(
        &mut self,
        n: &NodeProto,
        shown: &str,
        mut attrs: Vec<Attr>,
    ) -> Result<()> {
        let what = format!("node '{shown}' ({})", n.op_type);
        // The outer values the bodies read were appended to the inputs for ordering.
        let mut n = n.clone();
        if let Some(AttrValue::Int(k)) = take(&mut attrs, IMPLICIT) {
            let keep = n.input.len().saturating_sub(k as usize);
            n.input.truncate(keep);
        }
        let given = |key: &str| attrs.iter().any(|a| a.name == key);
        let mods = [given("score_mod"), given("prob_mod")];
        let mut a = Attrs::of(&n, shown, attrs)?;
        let graph = |a: &mut Attrs, key: &str| -> Result<GraphProto> {
            match a.take(key) {
                Some(AttrValue::Int(i)) => self
                    .graphs
                    .get(i as usize)
                    .cloned()
                    .ok_or_else(|| a.refuse(key, "is missing")),
                Some(v) => Err(a.wrong(key, "a graph", &v)),
                None => Err(a.refuse(
                    key,
                    "is missing (a YAML model has no subgraphs; If, Loop and Scan come from .onnx files)",
                )),
            }
        };
        match n.op_type.as_str() {
            "FlexAttention" => {
                let mut take =
                    |given: bool, key: &str| given.then(|| graph(&mut a, key)).transpose();
                let mods = [take(mods[0], "score_mod")?, take(mods[1], "prob_mod")?];
                tensors_only(&what, &mods.iter().flatten().collect::<Vec<_>>())?;
                a.what = format!("node '{shown}' (ai.onnx.preview::FlexAttention)");
                self.flex_attention(&n, &a.what.clone(), a, mods)
            }
            "If" => {
                let then = graph(&mut a, "then_branch")?;
                let other = graph(&mut a, "else_branch")?;
                a.finish()?;
                self.lower_if(&n, &what, &then, &other)
            }
            "Loop" => {
                let body = graph(&mut a, "body")?;
                a.finish()?;
                self.lower_loop(&n, &what, &body)
            }
            _ => {
                let body = graph(&mut a, "body")?;
                tensors_only(&what, &[&body])?;
                self.lower_scan(&n, &what, &body, a)
            }
        }
    }

    /// Inlines one copy of `body` with its inputs bound to `binds`; returns the values
    /// holding its outputs. `tag` names the copy's values and nodes.
    pub(super) fn inline(
        &mut self,
        what: &str,
        body: &GraphProto,
        binds: &[String],
        tag: &str,
    ) -> Result<Vec<String>> {
        if binds.len() != body.input.len() {
            return Err(Error::Graph(format!(
                "{what}: its body '{}' takes {} inputs; the node gives it {}",
                body.name,
                body.input.len(),
                binds.len()
            )));
        }
        // `taken` holds every value name of the model so far, copies included.
        let adds = body.node.len() + body.initializer.len();
        if self.taken.len() + adds > MAX_VALUES {
            return Err(Error::Graph(format!(
                "{what}: writing out another copy of its body '{}' ({adds} nodes) would take the model past {MAX_VALUES} values; graphrun writes control flow out when it loads the model",
                body.name
            )));
        }
        if !body.sparse_initializer.is_empty() {
            return Err(Error::Graph(format!(
                "{what}: its body '{}' has sparse initializers, which graphrun does not read",
                body.name
            )));
        }
        let mut map: HashMap<String, String> = HashMap::new();
        for (v, b) in body.input.iter().zip(binds) {
            map.insert(v.name.clone(), b.clone());
        }
        for t in &body.initializer {
            let value =
                crate::onnx::tensor::from_proto(t, self.base, &format!("{what}: initializer"))?;
            let name = self.fresh(&format!("{tag}/{}", t.name));
            self.declare(&name, &value);
            self.nodes.push(crate::graph::Node {
                name: format!("{tag}/{}", t.name),
                op: Op::Constant { value },
                inputs: vec![],
                outputs: vec![name.clone()],
                loc: None,
            });
            map.insert(t.name.clone(), name);
        }
        for n in &body.node {
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                let r = self.fresh(&format!("{tag}/{o}"));
                map.insert(o.clone(), r);
            }
        }
        // The body's declared types, under the copy's names, as a model's value_info.
        let mut copy = GraphProto {
            name: body.name.clone(),
            ..Default::default()
        };
        // A body input's type is declared where the value bound to it has none known.
        let unknown_inputs = body.input.iter().filter(|v| {
            map.get(&v.name)
                .is_some_and(|b| !self.ranks.contains_key(b))
        });
        for v in body
            .value_info
            .iter()
            .chain(&body.output)
            .chain(unknown_inputs)
        {
            if let Some(r) = map.get(&v.name) {
                let mut v = v.clone();
                v.name = r.clone();
                copy.value_info.push(v);
            }
        }
        for (k, n) in body.node.iter().enumerate() {
            let mut c = n.clone();
            let name = if n.name.is_empty() {
                format!("#{k}")
            } else {
                n.name.clone()
            };
            c.name = format!("{tag}/{name}");
            for v in c.input.iter_mut().chain(c.output.iter_mut()) {
                if let Some(r) = map.get(v.as_str()) {
                    *v = r.clone();
                }
            }
            for a in &mut c.attribute {
                if let Some(sub) = a.g.as_deref_mut() {
                    rename_free(sub, &map);
                }
                for sub in &mut a.graphs {
                    rename_free(sub, &map);
                }
            }
            copy.node.push(c);
        }
        self.declare_types(&copy);
        for (k, c) in copy.node.iter().enumerate() {
            self.node(k, c);
        }
        Ok(body
            .output
            .iter()
            .map(|o| map.get(&o.name).cloned().unwrap_or_else(|| o.name.clone()))
            .collect())
    }

    /// What the nodes and values written for `n` are named after: its name, or its first
    /// output's (value names are unique; node names may be empty).
    pub(super) fn flow_name(&self, n: &NodeProto, what: &str) -> String {
        [&n.name, n.output.first().unwrap_or(&n.name)]
            .into_iter()
            .find(|s| !s.is_empty())
            .cloned()
            .unwrap_or_else(|| what.to_string())
    }

    /// A node `op(ins)` with one new output named after `base`.
    fn flow_val(&mut self, name: &str, base: &str, op: Op, ins: Vec<String>) -> String {
        let out = self.fresh(base);
        self.nodes.push(crate::graph::Node {
            name: name.to_string(),
            op,
            inputs: ins,
            outputs: vec![out.clone()],
            loc: None,
        });
        out
    }

    /// `value` as the node's output `out` (an Identity, which the passes remove; a
    /// sequence's elements are `out`'s).
    fn bind(&mut self, name: &str, value: &str, out: &str) {
        if let Some(elems) = self.seqs.get(value).cloned() {
            self.seqs.insert(out.to_string(), elems);
            return;
        }
        self.nodes.push(crate::graph::Node {
            name: name.to_string(),
            op: Op::Identity,
            inputs: vec![value.to_string()],
            outputs: vec![out.to_string()],
            loc: None,
        });
    }

    fn index_const(&mut self, name: &str, base: &str, v: i64) -> String {
        let out = self.flow_val(
            name,
            base,
            Op::Constant {
                value: Tensor::scalar(v),
            },
            vec![],
        );
        self.dtypes.insert(out.clone(), DType::I64);
        self.ranks.insert(out.clone(), 0);
        out
    }

    /// A known boolean scalar (a condition), where the model fixes it.
    fn known_flag(&self, v: &str) -> Option<bool> {
        let t = self.constant_value(v)?;
        (t.numel() == 1).then(|| t.to_f64_vec()[0] != 0.0)
    }

    fn lower_if(
        &mut self,
        n: &NodeProto,
        what: &str,
        then: &GraphProto,
        other: &GraphProto,
    ) -> Result<()> {
        if n.input.len() != 1 || n.input[0].is_empty() {
            return Err(Error::Graph(format!(
                "{what}: If takes 1 input (cond), got {}",
                n.input.len()
            )));
        }
        for (b, which) in [(then, "then_branch"), (other, "else_branch")] {
            if b.output.len() != n.output.len() {
                return Err(Error::Graph(format!(
                    "{what}: {which} gives {} outputs; the node has {}",
                    b.output.len(),
                    n.output.len()
                )));
            }
        }
        let cond = n.input[0].clone();
        let base = self.flow_name(n, what);
        if let Some(c) = self.known_flag(&cond) {
            let (branch, tag) = if c { (then, "then") } else { (other, "else") };
            let outs = self.inline(what, branch, &[], &format!("{base}/{tag}"))?;
            for (k, (v, o)) in outs.iter().zip(&n.output).enumerate() {
                if !o.is_empty() {
                    self.bind(&format!("{base}/out{k}"), v, o);
                }
            }
            return Ok(());
        }
        // Fed at run time: both branches, selected. The condition is one element of any
        // rank; as a scalar it broadcasts without changing the outputs' ranks.
        let t = self.inline(what, then, &[], &format!("{base}/then"))?;
        let e = self.inline(what, other, &[], &format!("{base}/else"))?;
        let empty = self.flow_val(
            &format!("{base}/scalar_shape"),
            &format!("{base}/scalar_shape"),
            Op::Constant {
                value: Tensor::from_vec(&[0], Vec::<i64>::new())?,
            },
            vec![],
        );
        let c = self.flow_val(
            &format!("{base}/cond"),
            &format!("{base}/cond"),
            Op::Reshape { allowzero: false },
            vec![cond, empty],
        );
        for (k, o) in n.output.iter().enumerate() {
            if o.is_empty() {
                continue;
            }
            // Sequences of one length are selected element by element.
            match (self.seqs.get(&t[k]).cloned(), self.seqs.get(&e[k]).cloned()) {
                (None, None) => {}
                (Some(ts), Some(es)) if ts.len() == es.len() => {
                    let elems = ts
                        .iter()
                        .zip(&es)
                        .enumerate()
                        .map(|(j, (a, b))| {
                            self.flow_val(
                                &format!("{base}/select{k}_{j}"),
                                &format!("{o}/{j}"),
                                Op::Where,
                                vec![c.clone(), a.clone(), b.clone()],
                            )
                        })
                        .collect();
                    self.seqs.insert(o.clone(), elems);
                    continue;
                }
                (ts, es) => {
                    let kind = |v: &str, s: &Option<Vec<String>>| match s {
                        _ if self.empty.contains(v) => "an empty optional".to_string(),
                        Some(s) => format!("a sequence of {}", s.len()),
                        None => "a tensor".to_string(),
                    };
                    return Err(Error::Graph(format!(
                        "{what}: its condition is known only when it runs, and output {k} is {} in then_branch and {} in else_branch; graphrun runs both branches and selects, which needs tensors or sequences of one length",
                        kind(&t[k], &ts),
                        kind(&e[k], &es)
                    )));
                }
            }
            self.nodes.push(crate::graph::Node {
                name: format!("{base}/select{k}"),
                op: Op::Where,
                inputs: vec![c.clone(), t[k].clone(), e[k].clone()],
                outputs: vec![o.clone()],
                loc: None,
            });
        }
        Ok(())
    }

    fn lower_loop(&mut self, n: &NodeProto, what: &str, body: &GraphProto) -> Result<()> {
        let m = n.input.first().filter(|s| !s.is_empty()).cloned();
        let cond = n.input.get(1).filter(|s| !s.is_empty()).cloned();
        let carried: Vec<String> = n.input.iter().skip(2).cloned().collect();
        if carried.iter().any(String::is_empty) {
            return Err(Error::Graph(format!(
                "{what}: a loop-carried initial value is omitted"
            )));
        }
        let nv = carried.len();
        if body.input.len() != nv + 2 {
            return Err(Error::Graph(format!(
                "{what}: its body takes {} inputs; a Loop with {nv} loop-carried values gives it {}",
                body.input.len(),
                nv + 2
            )));
        }
        if body.output.len() < nv + 1 || n.output.len() != body.output.len() - 1 {
            return Err(Error::Graph(format!(
                "{what}: its body gives {} outputs and the node has {}; a Loop with {nv} loop-carried values needs 1 + {nv} + K and {nv} + K",
                body.output.len(),
                n.output.len()
            )));
        }
        let scans = body.output.len() - 1 - nv;
        let trips = match &m {
            None => None,
            Some(m) => match self.constant_value(m) {
                Some(t) if t.numel() == 1 => Some(t.to_f64_vec()[0].max(0.0) as u64),
                _ => {
                    return Err(Error::Graph(format!(
                        "{what}: its trip count '{m}' is not known when the model is loaded; graphrun writes a Loop out iteration by iteration, so the count must follow from constants and shapes (where it follows a symbolic input dim, give the shapes that will be fed when loading: the command line takes them from the --input files and --dim, the library from ImportOptions)"
                    )))
                }
            },
        };
        let first = match &cond {
            None => Some(true),
            Some(c) => self.known_flag(c),
        };
        // The body passes its condition through (a counted loop) when its cond output is
        // its cond input, directly or through an Identity.
        let cond_in = &body.input[1].name;
        let cond_out = &body.output[0].name;
        let passes = cond_out == cond_in
            || body.node.iter().any(|b| {
                b.op_type == "Identity"
                    && b.output.first() == Some(cond_out)
                    && b.input.first() == Some(cond_in)
            });
        let steps = match (trips, first, passes) {
            (_, Some(false), _) => 0,
            (Some(t), _, _) => t,
            (None, Some(true), true) => {
                return Err(Error::Graph(format!(
                    "{what}: it has no trip count and its condition never changes, so it never ends"
                )))
            }
            (None, _, _) => {
                return Err(Error::Graph(format!(
                    "{what}: it has no trip count and runs until its condition turns false, which is known only when it runs; graphrun writes a Loop out iteration by iteration, so it needs a trip count that follows from constants and shapes"
                )))
            }
        };
        if steps > MAX_STEPS as u64 {
            return Err(Error::Graph(format!(
                "{what}: it runs {steps} iterations; graphrun writes a Loop out iteration by iteration and takes up to {MAX_STEPS}"
            )));
        }
        // Known to run every iteration: no masking. Otherwise `running` holds whether the
        // condition still holds, and the values stop changing once it does not.
        let masked = !(first == Some(true) && passes);
        if masked && scans > 0 {
            return Err(Error::Graph(format!(
                "{what}: its {scans} scan output(s) have as many entries as iterations run, which its condition decides when it runs; graphrun writes a Loop out iteration by iteration and needs the number known when the model is loaded"
            )));
        }
        if steps == 0 && scans > 0 {
            return Err(Error::Graph(format!(
                "{what}: it runs no iterations, so its scan outputs are empty and their shapes unknown"
            )));
        }
        let base = self.flow_name(n, what);
        let mut running = match &cond {
            Some(c) => c.clone(),
            None => self.flow_val(
                &format!("{base}/cond"),
                &format!("{base}/cond"),
                Op::Constant {
                    value: Tensor::scalar(crate::tensor::Bool::TRUE),
                },
                vec![],
            ),
        };
        let mut values = carried;
        let mut scanned: Vec<Vec<String>> = vec![vec![]; scans];
        for k in 0..steps {
            let tag = format!("{base}/iter{k}");
            let i = self.index_const(&format!("{tag}/i"), &format!("{tag}/i"), k as i64);
            let mut binds = vec![i, running.clone()];
            binds.extend(values.iter().cloned());
            let outs = self.inline(what, body, &binds, &tag)?;
            let next = outs[1..=nv].to_vec();
            if let Some(v) = outs[1..].iter().find(|v| self.seqs.contains_key(*v)) {
                let which = match outs[1..=nv].contains(v) {
                    true => "loop-carried",
                    false => "scan output",
                };
                if masked || which == "scan output" {
                    return Err(Error::Graph(format!(
                        "{what}: its {which} value '{v}' is a sequence; graphrun carries a sequence through a Loop that runs a trip count known when the model is loaded, with no condition that may stop it early, and not as a scan output"
                    )));
                }
            }
            if masked {
                for (j, (new, old)) in next.iter().zip(values.clone()).enumerate() {
                    values[j] = self.flow_val(
                        &format!("{tag}/keep{j}"),
                        &format!("{tag}/keep{j}"),
                        Op::Where,
                        vec![running.clone(), new.clone(), old],
                    );
                }
                running = self.flow_val(
                    &format!("{tag}/running"),
                    &format!("{tag}/running"),
                    bin(BinaryOp::And),
                    vec![running.clone(), outs[0].clone()],
                );
            } else {
                values = next;
            }
            for (s, v) in scanned.iter_mut().zip(&outs[nv + 1..]) {
                s.push(v.clone());
            }
        }
        for (j, (v, o)) in values.iter().zip(&n.output).enumerate() {
            if !o.is_empty() {
                self.bind(&format!("{base}/out{j}"), v, o);
            }
        }
        for (s, (vals, o)) in scanned.iter().zip(&n.output[nv..]).enumerate() {
            if !o.is_empty() {
                self.stack(&format!("{base}/scan{s}"), vals, 0, o);
            }
        }
        Ok(())
    }

    /// `out` = the values stacked along a new axis `axis` (ONNX's axis of the output: a
    /// negative one counts from the output's end).
    fn stack(&mut self, name: &str, vals: &[String], axis: i64, out: &str) {
        let parts: Vec<String> = vals
            .iter()
            .enumerate()
            .map(|(k, v)| {
                self.flow_val(
                    &format!("{name}/part{k}"),
                    &format!("{out}/part{k}"),
                    unsqueeze(axis),
                    vec![v.clone()],
                )
            })
            .collect();
        self.nodes.push(crate::graph::Node {
            name: name.to_string(),
            op: Op::Concat { axis },
            inputs: parts,
            outputs: vec![out.to_string()],
            loc: None,
        });
    }

    fn lower_scan(
        &mut self,
        n: &NodeProto,
        what: &str,
        body: &GraphProto,
        mut a: Attrs,
    ) -> Result<()> {
        let m = match a.opt_int("num_scan_inputs")? {
            Some(m) if m >= 1 => m as usize,
            Some(m) => {
                return Err(a.refuse("num_scan_inputs", &format!("must be positive, got {m}")))
            }
            None => return Err(a.refuse("num_scan_inputs", "is missing")),
        };
        // Opset 8's Scan has a leading sequence_lens input and a batch axis.
        let batched = self.opset < 9;
        let (in_dirs, in_axes, out_dirs, out_axes) = if batched {
            (a.opt_ints("directions")?, None, None, None)
        } else {
            (
                a.opt_ints("scan_input_directions")?,
                a.opt_ints("scan_input_axes")?,
                a.opt_ints("scan_output_directions")?,
                a.opt_ints("scan_output_axes")?,
            )
        };
        a.finish()?;
        let mut inputs = n.input.clone();
        if batched {
            let lens = inputs.remove(0);
            if !lens.is_empty() {
                return Err(Error::Graph(format!(
                    "{what}: sequence_lens ('{lens}') is given; graphrun's Scan runs every sequence to its full length (leave the input empty)"
                )));
            }
        }
        if inputs.len() < m || inputs.iter().any(String::is_empty) {
            return Err(Error::Graph(format!(
                "{what}: it has {} inputs, fewer than num_scan_inputs = {m}, or an omitted one",
                inputs.len()
            )));
        }
        let ns = inputs.len() - m;
        if body.output.len() < ns || n.output.len() != body.output.len() {
            return Err(Error::Graph(format!(
                "{what}: its body gives {} outputs and the node has {}; a Scan with {ns} state values needs as many of each, at least {ns}",
                body.output.len(),
                n.output.len()
            )));
        }
        let k = body.output.len() - ns;
        let list = |v: Option<Vec<i64>>, len: usize, key: &str| -> Result<Vec<i64>> {
            let v = v.unwrap_or_else(|| vec![0; len]);
            if v.len() != len {
                return Err(Error::Graph(format!(
                    "{what}: {key} has {} entries; it needs one per {} ({len})",
                    v.len(),
                    if key.contains("input") || key == "directions" {
                        "scan input"
                    } else {
                        "scan output"
                    }
                )));
            }
            Ok(v)
        };
        let in_dirs = list(
            in_dirs,
            m,
            if batched {
                "directions"
            } else {
                "scan_input_directions"
            },
        )?;
        let in_axes = list(in_axes, m, "scan_input_axes")?;
        let out_dirs = list(out_dirs, k, "scan_output_directions")?;
        let out_axes = list(out_axes, k, "scan_output_axes")?;
        let (states, xs) = (inputs[..ns].to_vec(), inputs[ns..].to_vec());
        let base = self.flow_name(n, what);
        // The length of each scan input along its scan axis (with opset 8's batch axis in
        // front); they must agree.
        let axis_of = |im: &Self, x: &str, a: i64| -> Result<(usize, usize)> {
            let r = im.ranks.get(x).copied().ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: the rank of scan input '{x}' is not known when the model is loaded"
                ))
            })?;
            let lead = usize::from(batched);
            let ax = if a < 0 { a + (r - lead) as i64 } else { a };
            if ax < 0 || ax as usize >= r - lead.min(r) {
                return Err(Error::Graph(format!(
                    "{what}: scan axis {a} is out of range for scan input '{x}' of rank {r}"
                )));
            }
            let ax = ax as usize + lead;
            let len = im.dims.get(x).and_then(|d| d.get(ax).copied().flatten()).ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: the length of scan input '{x}' along axis {ax} is not known when the model is loaded; graphrun writes a Scan out step by step, so it needs the length when loading: give the shapes that will be fed (the command line takes them from the --input files and --dim, the library from ImportOptions), or export the model with a fixed length"
                ))
            })?;
            Ok((ax, len))
        };
        let mut axes = vec![];
        let mut steps = None;
        for (x, &a) in xs.iter().zip(&in_axes) {
            let (ax, len) = axis_of(self, x, a)?;
            if steps.is_some_and(|s| s != len) {
                return Err(Error::Graph(format!(
                    "{what}: scan input '{x}' has {len} steps along axis {ax}, unlike the first scan input's {}",
                    steps.unwrap_or(0)
                )));
            }
            steps = Some(len);
            axes.push(ax as i64);
        }
        let steps = steps.unwrap_or(0);
        if steps > MAX_STEPS {
            return Err(Error::Graph(format!(
                "{what}: it scans {steps} steps; graphrun writes a Scan out step by step and takes up to {MAX_STEPS}"
            )));
        }
        if steps == 0 && k > 0 {
            return Err(Error::Graph(format!(
                "{what}: its scan inputs have no steps, so its scan outputs are empty and their shapes unknown"
            )));
        }
        let scan = Scan {
            body,
            in_dirs: &in_dirs,
            out_dirs: &out_dirs,
            out_axes: &out_axes,
            steps,
        };
        if !batched {
            let (fin, outs) = self.scan_steps(what, &scan, states, xs, &axes, &base)?;
            for (j, (v, o)) in fin.iter().chain(&outs).zip(&n.output).enumerate() {
                if !o.is_empty() {
                    self.bind(&format!("{base}/out{j}"), v, o);
                }
            }
            return Ok(());
        }
        // Opset 8: each batch entry scanned on its own, the results stacked on axis 0.
        let batch = xs
            .first()
            .and_then(|x| self.dims.get(x).and_then(|d| d.first().copied().flatten()))
            .ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: the batch size of scan input '{}' is not known when the model is loaded",
                    xs[0]
                ))
            })?;
        let mut results: Vec<Vec<String>> = vec![vec![]; n.output.len()];
        for b in 0..batch {
            let tag = format!("{base}/batch{b}");
            let idx = self.index_const(&format!("{tag}/b"), &format!("{tag}/b"), b as i64);
            let pick = |im: &mut Self, v: &String, j: usize| {
                im.flow_val(
                    &format!("{tag}/in{j}"),
                    &format!("{tag}/in{j}"),
                    Op::Gather { axis: 0 },
                    vec![v.clone(), idx.clone()],
                )
            };
            let st: Vec<String> = states
                .iter()
                .enumerate()
                .map(|(j, v)| pick(self, v, j))
                .collect();
            let x: Vec<String> = xs
                .iter()
                .enumerate()
                .map(|(j, v)| pick(self, v, ns + j))
                .collect();
            let inner: Vec<i64> = axes.iter().map(|a| a - 1).collect();
            let (fin, outs) = self.scan_steps(what, &scan, st, x, &inner, &tag)?;
            for (r, v) in results.iter_mut().zip(fin.into_iter().chain(outs)) {
                r.push(v);
            }
        }
        for (j, (vals, o)) in results.iter().zip(&n.output).enumerate() {
            if !o.is_empty() {
                self.stack(&format!("{base}/out{j}"), vals, 0, o);
            }
        }
        Ok(())
    }

    /// The steps of a Scan over `xs` (each along its axis in `axes`) from `states`: the
    /// final states and the stacked scan outputs.
    fn scan_steps(
        &mut self,
        what: &str,
        s: &Scan,
        mut states: Vec<String>,
        xs: Vec<String>,
        axes: &[i64],
        base: &str,
    ) -> Result<(Vec<String>, Vec<String>)> {
        let ns = states.len();
        let mut scanned: Vec<Vec<String>> = vec![vec![]; s.out_axes.len()];
        for t in 0..s.steps {
            let tag = format!("{base}/step{t}");
            let mut binds = states.clone();
            for (j, x) in xs.iter().enumerate() {
                let at = if s.in_dirs[j] == 1 {
                    s.steps - 1 - t
                } else {
                    t
                };
                let idx =
                    self.index_const(&format!("{tag}/t{j}"), &format!("{tag}/t{j}"), at as i64);
                binds.push(self.flow_val(
                    &format!("{tag}/slice{j}"),
                    &format!("{tag}/slice{j}"),
                    Op::Gather { axis: axes[j] },
                    vec![x.clone(), idx],
                ));
            }
            let outs = self.inline(what, s.body, &binds, &tag)?;
            states = outs[..ns].to_vec();
            for (acc, v) in scanned.iter_mut().zip(&outs[ns..]) {
                acc.push(v.clone());
            }
        }
        let mut stacked = vec![];
        for (j, mut vals) in scanned.into_iter().enumerate() {
            if s.out_dirs[j] == 1 {
                vals.reverse();
            }
            let out = self.fresh(&format!("{base}/scan{j}"));
            self.stack(&format!("{base}/scan{j}"), &vals, s.out_axes[j], &out);
            stacked.push(out);
        }
        Ok((states, stacked))
    }
}

/// What every step of one Scan shares.
struct Scan<'a> {
    body: &'a GraphProto,
    in_dirs: &'a [i64],
    out_dirs: &'a [i64],
    out_axes: &'a [i64],
    steps: usize,
}

/// Refuses bodies whose inputs or outputs are sequences (or optionals of them): a body is
/// written out per step on tensors, and a sequence is a list graphrun writes out at load.
fn tensors_only(what: &str, bodies: &[&GraphProto]) -> Result<()> {
    for v in bodies.iter().flat_map(|b| b.input.iter().chain(&b.output)) {
        if v.r#type.as_ref().is_some_and(|t| t.sequence_of().is_some()) {
            return Err(Error::Graph(format!(
                "{what}: its body's value '{}' is a sequence; graphrun does not carry sequences through If, Loop and Scan",
                v.name
            )));
        }
    }
    Ok(())
}
