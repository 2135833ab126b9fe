//! What a family's inference reads: the node, its input types, the input values known on
//! the host, and the host evaluator; with the checks every family shares, each failing
//! with a message that names the node and its input types (`fail`).

use super::*;

/// One node being inferred.
pub(super) struct Cx<'a> {
    pub node: &'a Node,
    /// Input types; `None` for an omitted optional input.
    pub ins: &'a [Option<&'a ValueType>],
    /// Input values known on the host.
    pub consts: &'a [Option<&'a Tensor>],
    pub ev: &'a dyn HostEval,
}

impl<'a> Cx<'a> {
    /// A failure of this node's inference.
    pub fn fail(&self, msg: String) -> Error {
        fail(self.node, self.ins, msg)
    }
    /// Input `i`'s type, if given.
    pub fn t(&self, i: usize) -> Option<&'a ValueType> {
        self.ins.get(i).copied().flatten()
    }
    /// Input 0's type (a scalar f32 stands in when there is none).
    pub fn x(&self) -> ValueType {
        self.t(0)
            .cloned()
            .unwrap_or(ValueType::new(DType::F32, &[]))
    }
    pub fn need_float(&self, v: &ValueType, what: &str) -> Result<()> {
        if v.dtype.is_float() {
            Ok(())
        } else {
            Err(self.fail(format!("{what} must be a floating dtype, got {}", v.dtype)))
        }
    }
    pub fn need_int(&self, v: &ValueType, what: &str) -> Result<()> {
        if v.dtype.is_int() {
            Ok(())
        } else {
            Err(self.fail(format!("{what} must be i64 or i32, got {}", v.dtype)))
        }
    }
    pub fn same_dtype(&self, a: &ValueType, b: &ValueType) -> Result<()> {
        if a.dtype == b.dtype {
            Ok(())
        } else {
            Err(self.fail(format!("input dtypes differ: {} and {}", a.dtype, b.dtype)))
        }
    }
    /// A shape-deciding input that must be known on the host (`None`: omitted).
    pub fn known(&self, i: usize, what: &str) -> Result<Option<Vec<i64>>> {
        // `plan_time_inputs` finds the graph inputs to plan with from that table.
        debug_assert!(shape_inputs(&self.node.op).iter().any(|&(k, _)| k == i));
        match (self.t(i), self.consts.get(i).copied().flatten()) {
            (None, _) => Ok(None),
            (Some(v), _) if !v.dtype.is_int() => Err(self.fail(format!("{what} (input {i}) must be i64 or i32, got {}", v.dtype))),
            (Some(_), Some(c)) => Ok(Some(c.to_i64_vec())),
            (Some(_), None) => Err(self.fail(format!(
                "{what} (input '{}') must be known when the plan is made (computed from initializers, Constants, Shape and the graph inputs fed when planning, through small nodes evaluated on the host), but it depends on a value that is not (one computed at run time, or a tensor too large to evaluate on the host)",
                self.node.inputs[i]
            ))),
        }
    }
    /// `axes` normalised for rank `r`, each in range and none repeated.
    pub fn axes_norm(&self, axes: &[i64], r: usize) -> Result<Vec<usize>> {
        let mut out = vec![];
        for &a in axes {
            let Some(n) = norm_axis(a, r) else {
                return Err(self.fail(format!("axis {a} is out of range for rank {r}")));
            };
            if out.contains(&n) {
                return Err(self.fail(format!("axis {a} is repeated")));
            }
            out.push(n);
        }
        Ok(out)
    }
    /// Infers the forward op a gradient op (or a scatter, its gather) mirrors, on the
    /// forward's input types, so it is checked by exactly the rules of that op; messages
    /// name this node's op.
    pub fn forward(
        &self,
        op: Op,
        ins: &[Option<&ValueType>],
        consts: &[Option<&Tensor>],
    ) -> Result<Vec<ValueType>> {
        let node = self.node;
        let fwd = Node {
            name: node.name.clone(),
            op,
            inputs: (0..ins.len()).map(|i| format!("in{i}")).collect(),
            outputs: vec!["y".into()],
            loc: node.loc.clone(),
        };
        infer_node(&fwd, ins, consts, self.ev).map_err(|e| match e {
            Error::Graph(m) => Error::Graph(m.replace(
                &format!("({})", fwd.op.name()),
                &format!("({})", node.op.name()),
            )),
            e => e,
        })
    }
}
