//! Sequences of tensors, written out when the model is loaded: a sequence value is the
//! list of its tensors' values, and its ops (construct, insert, erase, at, length, split,
//! concat) rearrange that list or become the tensor ops they amount to. So every length
//! and position must be known then: a position from a constant or initializer, a
//! SplitToSequence's parts from its input's declared size. A graph input of a sequence
//! type is its elements, fed as the inputs `name[0]`, `name[1]`, ...; a sequence output
//! is given as the outputs `name[i]` the same way (`onnx::import`). SequenceMap's body
//! is written out once per element. Sequences carried through If and Loop are refused by
//! name.

use super::composite::{inputs, output};
use super::control::MAX_VALUES;
use super::recurrent::MAX_STEPS;
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::{Node, Op};
use crate::onnx::proto::NodeProto;
use crate::onnx::tensor::from_proto;
use crate::tensor::Tensor;
use std::collections::HashMap;

/// The operators written here.
pub(super) const SEQUENCE: &[&str] = &[
    "SequenceConstruct",
    "SequenceEmpty",
    "SequenceInsert",
    "SequenceErase",
    "SequenceAt",
    "SequenceLength",
    "SplitToSequence",
    "ConcatFromSequence",
    "SequenceMap",
];

/// The sequence ops whose outputs are sequences.
pub(super) const MAKES_SEQUENCE: &[&str] = &[
    "SequenceConstruct",
    "SequenceEmpty",
    "SequenceInsert",
    "SequenceErase",
    "SplitToSequence",
    "SequenceMap",
];

/// The value name of element `i` of the sequence graph input or output `name`.
pub fn element_name(name: &str, i: usize) -> String {
    format!("{name}[{i}]")
}

impl Importer<'_> {
    /// The graph outputs `outputs` with each sequence among them replaced by its
    /// elements, `name[i]` (Identity nodes give them those names).
    pub(crate) fn sequence_outputs(&mut self, outputs: &[String]) -> Vec<String> {
        let mut out = vec![];
        for o in outputs {
            let Some(items) = self.seqs.get(o).cloned() else {
                out.push(o.clone());
                continue;
            };
            for (i, item) in items.into_iter().enumerate() {
                let e = element_name(o, i);
                let name = self.fresh(&format!("{o}/element{i}"));
                self.nodes.push(Node {
                    name,
                    op: Op::Identity,
                    inputs: vec![item],
                    outputs: vec![e.clone()],
                    loc: None,
                });
                out.push(e);
            }
        }
        out
    }

    /// Whether `n` reads or writes a sequence (an op of `SEQUENCE`, or an Identity,
    /// Optional or OptionalGetElement of a sequence).
    pub(super) fn is_sequence_node(&self, n: &NodeProto) -> bool {
        SEQUENCE.contains(&n.op_type.as_str())
            || (matches!(
                n.op_type.as_str(),
                "Identity" | "Optional" | "OptionalGetElement"
            ) && n.input.first().is_some_and(|i| self.seqs.contains_key(i)))
    }

    pub(super) fn lower_sequence(&mut self, n: &NodeProto, shown: &str) -> Result<()> {
        let op = n.op_type.as_str();
        let what = format!("node '{shown}' ({op})");
        let out = output(n, 0)
            .ok_or_else(|| Error::Graph(format!("{what} has no output")))?
            .to_string();
        let input = |k: usize| n.input.get(k).filter(|i| !i.is_empty());
        let seq = |k: usize| -> Result<Vec<String>> {
            let name = input(k).ok_or_else(|| {
                Error::Graph(format!("{what}: input {k} (a sequence) is missing"))
            })?;
            self.seqs.get(name).cloned().ok_or_else(|| {
                Error::Graph(format!(
                    "{what}: input '{name}' is not a sequence graphrun knows when the model is loaded"
                ))
            })
        };
        match op {
            "Identity" | "Optional" | "OptionalGetElement" => {
                let items = seq(0)?;
                self.seqs.insert(out, items);
            }
            "SequenceConstruct" => {
                let items: Vec<String> =
                    n.input.iter().filter(|i| !i.is_empty()).cloned().collect();
                self.seqs.insert(out, items);
            }
            "SequenceEmpty" => {
                self.seqs.insert(out, vec![]);
            }
            "SequenceLength" => {
                let len = seq(0)?.len() as i64;
                self.push(
                    n,
                    "",
                    Op::Constant {
                        value: Tensor::scalar(len),
                    },
                    vec![],
                    &out,
                );
            }
            "SequenceAt" => {
                let items = seq(0)?;
                let at = self.position(n, &what, 1, items.len(), false)?;
                self.push(n, "", Op::Identity, vec![items[at].clone()], &out);
            }
            "SequenceInsert" => {
                let mut items = seq(0)?;
                let t = input(1)
                    .ok_or_else(|| {
                        Error::Graph(format!("{what}: input 1 (the tensor) is missing"))
                    })?
                    .clone();
                let at = match input(2) {
                    Some(_) => self.position(n, &what, 2, items.len(), true)?,
                    None => items.len(),
                };
                items.insert(at, t);
                self.seqs.insert(out, items);
            }
            "SequenceErase" => {
                let mut items = seq(0)?;
                if items.is_empty() {
                    return Err(Error::Graph(format!("{what}: the sequence is empty")));
                }
                let at = match input(1) {
                    Some(_) => self.position(n, &what, 1, items.len(), false)?,
                    None => items.len() - 1,
                };
                items.remove(at);
                self.seqs.insert(out, items);
            }
            "ConcatFromSequence" => {
                let items = seq(0)?;
                if items.is_empty() {
                    return Err(Error::Graph(format!(
                        "{what}: the sequence is empty, and a concatenation needs a tensor"
                    )));
                }
                let axis = int_attr(n, "axis", i64::MIN);
                if axis == i64::MIN {
                    return Err(Error::Graph(format!(
                        "{what}: attribute 'axis' is required"
                    )));
                }
                let parts = if int_attr(n, "new_axis", 0) != 0 {
                    // Each element gains the axis, then they are joined along it.
                    items
                        .iter()
                        .map(|t| {
                            let u = self.fresh(&format!("{out}/unsqueezed"));
                            let op = Op::Unsqueeze {
                                axes: Some(vec![axis]),
                            };
                            let helper = u[out.len() + 1..].to_string();
                            self.push(n, &helper, op, vec![t.clone()], &u);
                            u
                        })
                        .collect()
                } else {
                    items
                };
                self.push(n, "", Op::Concat { axis }, parts, &out);
            }
            "SplitToSequence" => return self.split_to_sequence(n, &what, &out),
            "SequenceMap" => return self.sequence_map(n, &what),
            _ => unreachable!("SEQUENCE lists the ops handled here"),
        }
        Ok(())
    }

    /// A Split of `inputs` into `count` parts named after the sequence `out`.
    fn split_parts(
        &mut self,
        n: &NodeProto,
        out: &str,
        axis: i64,
        split: Option<Vec<i64>>,
        inputs: Vec<String>,
        count: usize,
    ) -> Vec<String> {
        let parts: Vec<String> = (0..count)
            .map(|i| self.fresh(&format!("{out}/{i}")))
            .collect();
        self.nodes.push(Node {
            name: n.name.clone(),
            op: Op::Split {
                axis,
                split,
                num_outputs: None,
            },
            inputs,
            outputs: parts.clone(),
            loc: None,
        });
        parts
    }

    /// SplitToSequence: a Split into the parts its `split` input (or its absence) makes of
    /// the input's size along `axis`, each part an element.
    fn split_to_sequence(&mut self, n: &NodeProto, what: &str, out: &str) -> Result<()> {
        let (req, opt) = inputs(n, what, (1, 2), 1)?;
        let x = req[0].clone();
        let (axis, keepdims) = (int_attr(n, "axis", 0), int_attr(n, "keepdims", 1));
        let dims = self.dims.get(&x).cloned();
        let rank = self.ranks.get(&x).copied().or(dims.as_ref().map(Vec::len));
        let size = rank.and_then(|r| {
            let a = if axis < 0 { axis + r as i64 } else { axis };
            let a = usize::try_from(a).ok().filter(|&a| a < r)?;
            dims.as_ref()?.get(a).copied().flatten()
        });
        let Some(size) = size else {
            return Err(Error::Graph(format!(
                "{what}: the size of '{x}' along axis {axis} is not known when the model is loaded; graphrun writes a sequence out element by element, so it splits inputs whose size the model declares"
            )));
        };
        // A sequence of one element per step at most as long as a recurrence's.
        let too_long = |parts: usize| {
            Error::Graph(format!(
                "{what}: {parts} parts would be more than the {MAX_STEPS} elements graphrun writes a sequence out to"
            ))
        };
        // A 1-D split fed at run time: its length, declared, is the number of elements,
        // and Split reads the sizes when the plan is made.
        if let Some(s) = opt[0].as_ref().filter(|s| self.constant_value(s).is_none()) {
            let parts = match self.dims.get(s).map(Vec::as_slice) {
                Some(&[Some(l)]) => l,
                _ => {
                    return Err(Error::Graph(format!(
                        "{what}: its split '{s}' is not known when the model is loaded (a constant or initializer), nor is it a list of declared length"
                    )))
                }
            };
            if parts > MAX_STEPS {
                return Err(too_long(parts));
            }
            let items = self.split_parts(n, out, axis, None, vec![x, s.clone()], parts);
            self.seqs.insert(out.to_string(), items);
            return Ok(());
        }
        let split = opt[0].as_ref().and_then(|s| self.constant_value(s));
        let sizes: Vec<i64> = match &split {
            None if size > MAX_STEPS => return Err(too_long(size)),
            None => vec![1; size],
            Some(t) if t.shape().is_empty() => {
                let chunk = t.to_f64_vec()[0] as i64;
                if chunk <= 0 {
                    return Err(Error::Graph(format!(
                        "{what}: split {chunk} is not positive"
                    )));
                }
                let size = size as i64;
                (0..size)
                    .step_by(chunk as usize)
                    .map(|s| chunk.min(size - s))
                    .collect()
            }
            Some(t) if t.numel() > MAX_STEPS => return Err(too_long(t.numel())),
            Some(t) => t.to_f64_vec().iter().map(|&v| v as i64).collect(),
        };
        if sizes.iter().any(|&s| s < 0) || sizes.iter().sum::<i64>() != size as i64 {
            return Err(Error::Graph(format!(
                "{what}: split {sizes:?} does not add up to {size}, the size of '{x}' along axis {axis}"
            )));
        }
        let squeeze = split.is_none() && keepdims == 0;
        let count = sizes.len();
        let parts = self.split_parts(n, out, axis, Some(sizes), vec![x], count);
        let items = if squeeze {
            parts
                .into_iter()
                .map(|p| {
                    let s = self.fresh(&format!("{p}/squeezed"));
                    let helper = s[out.len() + 1..].to_string();
                    self.push(
                        n,
                        &helper,
                        Op::Squeeze {
                            axes: Some(vec![axis]),
                        },
                        vec![p],
                        &s,
                    );
                    s
                })
                .collect()
        } else {
            parts
        };
        self.seqs.insert(out.to_string(), items);
        Ok(())
    }

    /// SequenceMap: the body written out once per element of the first input, each
    /// copy reading element i of every sequence input and the tensor inputs whole; output
    /// k is the sequence of the copies' output k.
    fn sequence_map(&mut self, n: &NodeProto, what: &str) -> Result<()> {
        let body = n
            .attribute
            .iter()
            .find(|a| a.name == "body")
            .and_then(|a| a.g.as_deref())
            .cloned()
            .ok_or_else(|| {
                Error::Graph(format!("{what}: attribute 'body' (a graph) is missing"))
            })?;
        if body.node.iter().any(|b| {
            b.attribute
                .iter()
                .any(|a| a.g.is_some() || !a.graphs.is_empty())
        }) {
            return Err(Error::Graph(format!(
                "{what}: its body has nodes with graphs of their own, which graphrun does not write out inside a SequenceMap"
            )));
        }
        if body.input.len() != n.input.len() || body.output.len() != n.output.len() {
            return Err(Error::Graph(format!(
                "{what}: its body takes {} inputs and gives {} outputs; the node has {} and {}",
                body.input.len(),
                body.output.len(),
                n.input.len(),
                n.output.len()
            )));
        }
        let len = match n.input.first().and_then(|i| self.seqs.get(i)) {
            Some(items) => items.len(),
            None => {
                return Err(Error::Graph(format!(
                    "{what}: input 0 is not a sequence graphrun knows when the model is loaded"
                )))
            }
        };
        for i in &n.input {
            if let Some(items) = self.seqs.get(i).filter(|s| s.len() != len) {
                return Err(Error::Graph(format!(
                    "{what}: sequence '{i}' has {} elements and the first input {len}",
                    items.len()
                )));
            }
        }
        let stem = n.output.first().cloned().unwrap_or_default();
        let mut outs = vec![vec![]; n.output.len()];
        for e in 0..len {
            if self.taken.len() + body.node.len() > MAX_VALUES {
                return Err(Error::Graph(format!(
                    "{what}: writing out another copy of its body ({} nodes) would take the model past {MAX_VALUES} values",
                    body.node.len()
                )));
            }
            let mut rename: HashMap<String, String> = HashMap::new();
            for (b, i) in body.input.iter().zip(&n.input) {
                let bound = match self.seqs.get(i) {
                    Some(items) => items[e].clone(),
                    None => i.clone(),
                };
                rename.insert(b.name.clone(), bound);
            }
            for t in &body.initializer {
                let value = from_proto(
                    t,
                    self.base,
                    &format!("{what}: body initializer '{}'", t.name),
                )?;
                let name = self.fresh(&format!("{stem}/map{e}/{}", t.name));
                self.nodes.push(Node {
                    name: name.clone(),
                    op: Op::Constant { value },
                    inputs: vec![],
                    outputs: vec![name.clone()],
                    loc: None,
                });
                rename.insert(t.name.clone(), name);
            }
            for (j, b) in body.node.iter().enumerate() {
                let mut copy = b.clone();
                for i in &mut copy.input {
                    if let Some(r) = rename.get(i) {
                        *i = r.clone();
                    }
                }
                for o in copy.output.iter_mut().filter(|o| !o.is_empty()) {
                    let r = self.fresh(&format!("{stem}/map{e}/{o}"));
                    rename.insert(o.clone(), r.clone());
                    *o = r;
                }
                let name = if b.name.is_empty() {
                    format!("#{j}")
                } else {
                    b.name.clone()
                };
                copy.name = self.fresh(&format!("{}/map{e}/{name}", n.name));
                self.node(j, &copy);
            }
            for (k, o) in body.output.iter().enumerate() {
                let v = rename
                    .get(&o.name)
                    .cloned()
                    .unwrap_or_else(|| o.name.clone());
                if self.seqs.contains_key(&v) {
                    return Err(Error::Graph(format!(
                        "{what}: its body's output '{}' is a sequence; graphrun takes sequences of tensors",
                        o.name
                    )));
                }
                outs[k].push(v);
            }
        }
        for (o, items) in n.output.iter().zip(outs) {
            if !o.is_empty() {
                self.seqs.insert(o.clone(), items);
            }
        }
        Ok(())
    }

    /// The position input `k` of `n` names, as an index into a sequence of `len` (ONNX
    /// counts negative positions from the end; `insert` allows `len` itself).
    fn position(
        &self,
        n: &NodeProto,
        what: &str,
        k: usize,
        len: usize,
        insert: bool,
    ) -> Result<usize> {
        let name = n.input.get(k).map_or("", String::as_str);
        let t = self.constant_value(name).ok_or_else(|| {
            Error::Graph(format!(
                "{what}: its position '{name}' is not known when the model is loaded (a constant or initializer); graphrun writes sequences out when it loads a model"
            ))
        })?;
        let p = t.to_f64_vec().first().copied().unwrap_or(f64::NAN) as i64;
        let end = len as i64 + i64::from(insert);
        let at = if p < 0 { p + len as i64 } else { p };
        if !(0..end).contains(&at) {
            return Err(Error::Graph(format!(
                "{what}: position {p} is outside the sequence of {len} elements"
            )));
        }
        Ok(at as usize)
    }
}

/// Integer attribute `name` of `n`, or `default` where it is absent.
fn int_attr(n: &NodeProto, name: &str, default: i64) -> i64 {
    n.attribute
        .iter()
        .find(|a| a.name == name)
        .map_or(default, |a| a.i)
}
