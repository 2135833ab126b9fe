//! Optionals of tensors. Whether an optional holds its tensor is known when the model is
//! loaded: an `Optional` node is given its input or not, and a graph input of an
//! optional type is a tensor the caller feeds. So an optional is written as its tensor,
//! or, empty, as no value at all (an op that reads it sees its input left out), and
//! OptionalHasElement is a constant. Optionals of sequences are refused with sequences.

use super::composite::output;
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::{Node, Op};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};

/// The operators written here.
pub(super) const OPTIONAL: &[&str] = &["Optional", "OptionalHasElement", "OptionalGetElement"];

impl Importer<'_> {
    /// `n` with every input that names an empty optional left out (""), as ONNX lets an
    /// op's optional inputs be.
    pub(super) fn without_empty(&self, n: &NodeProto) -> Option<NodeProto> {
        if !n.input.iter().any(|i| self.empty.contains(i)) {
            return None;
        }
        let mut n = n.clone();
        for i in &mut n.input {
            if self.empty.contains(i) {
                i.clear();
            }
        }
        Some(n)
    }

    pub(super) fn lower_optional(&mut self, n: &NodeProto, shown: &str) -> Result<()> {
        let op = n.op_type.as_str();
        let Some(out) = output(n, 0).map(str::to_string) else {
            return Err(Error::Graph(format!("node '{shown}' ({op}) has no output")));
        };
        let held = n
            .input
            .first()
            .filter(|i| !i.is_empty() && !self.empty.contains(*i))
            .cloned();
        let node = |op: Op, inputs: Vec<String>| Node {
            name: n.name.clone(),
            op,
            inputs,
            outputs: vec![out.clone()],
            loc: None,
        };
        match (op, held) {
            ("OptionalHasElement", x) => {
                let has = f64::from(u8::from(x.is_some()));
                let value = Tensor::from_f64(DType::Bool, &[], &[has])?;
                self.nodes.push(node(Op::Constant { value }, vec![]));
            }
            (_, Some(x)) => {
                self.nodes.push(node(Op::Identity, vec![x]));
            }
            ("Optional", None) => {
                self.empty.insert(out);
            }
            (_, None) => {
                let what = n.input.first().map_or("", String::as_str);
                return Err(Error::Graph(format!(
                    "node '{shown}' ({op}): its input{} is an empty optional, which holds no element to get",
                    if what.is_empty() { String::new() } else { format!(" '{what}'") }
                )));
            }
        }
        Ok(())
    }
}
