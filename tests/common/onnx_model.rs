//! One-node ONNX models built with prost, for the tests of what the importer writes.
#![allow(dead_code)]

use graphrun::onnx::proto::{
    attr_type, AttributeProto, Dimension, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
    TensorProto, TensorShapeProto, TypeProto, TypeProtoTensor, ValueInfoProto,
};
use graphrun::{DType, Tensor};
use prost::Message;

pub fn int_attr(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::INT,
        i: v,
        ..Default::default()
    }
}

pub fn float_attr(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::FLOAT,
        f: v,
        ..Default::default()
    }
}

pub fn str_attr(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::STRING,
        s: v.as_bytes().to_vec(),
        ..Default::default()
    }
}

pub fn ints_attr(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::INTS,
        ints: v.to_vec(),
        ..Default::default()
    }
}

pub fn floats_attr(name: &str, v: &[f32]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::FLOATS,
        floats: v.to_vec(),
        ..Default::default()
    }
}

pub fn strs_attr(name: &str, v: &[&str]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::STRINGS,
        strings: v.iter().map(|s| s.as_bytes().to_vec()).collect(),
        ..Default::default()
    }
}

pub fn tensor_attr(name: &str, t: &Tensor) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: attr_type::TENSOR,
        t: Some(initializer(name, t)),
        ..Default::default()
    }
}

/// The ONNX element type (TensorProto.DataType) of a dtype.
pub fn elem_type(dt: DType) -> i32 {
    dt.onnx_code()
}

/// A graph input of `dtype` with these dims (None: a named symbolic dim, bound when fed).
pub fn input(name: &str, dtype: DType, dims: &[Option<usize>]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .enumerate()
        .map(|(k, d)| Dimension {
            dim_value: d.map(|d| d as i64),
            dim_param: if d.is_none() {
                Some(format!("{name}_d{k}"))
            } else {
                None
            },
        })
        .collect();
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            tensor_type: Some(TypeProtoTensor {
                elem_type: elem_type(dtype),
                shape: Some(TensorShapeProto { dim }),
            }),
            ..Default::default()
        }),
    }
}

/// A graph input with the fixed shape of `t`.
pub fn input_like(name: &str, t: &Tensor) -> ValueInfoProto {
    let dims: Vec<Option<usize>> = t.shape().iter().map(|&d| Some(d)).collect();
    input(name, t.dtype(), &dims)
}

/// An initializer holding `t` (raw little-endian data).
pub fn initializer(name: &str, t: &Tensor) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: elem_type(t.dtype()),
        raw_data: t.bytes().to_vec(),
        ..Default::default()
    }
}

/// A node of `op` (in `domain`, "" for ai.onnx).
pub fn node(
    op: &str,
    domain: &str,
    ins: &[&str],
    outs: &[&str],
    attrs: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        op_type: op.into(),
        domain: domain.into(),
        name: format!("{op}_node"),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: outs.iter().map(|s| s.to_string()).collect(),
        attribute: attrs,
    }
}

/// Imports a one-node model: ai.onnx at `opset` (and com.microsoft 1 when the node is in
/// that domain); the graph outputs are the node's named outputs.
/// A serialized model of these nodes, graph inputs, initializers and outputs.
pub fn model_bytes(
    nodes: Vec<NodeProto>,
    opset: i64,
    inputs: Vec<ValueInfoProto>,
    inits: Vec<TensorProto>,
    outputs: &[&str],
) -> Vec<u8> {
    let outputs = outputs.iter().map(|o| o.to_string()).collect();
    serialized(nodes, default_opset(opset), inputs, inits, outputs)
}

fn default_opset(opset: i64) -> Vec<OperatorSetIdProto> {
    vec![OperatorSetIdProto {
        domain: String::new(),
        version: opset,
    }]
}

/// A ModelProto of these parts, serialized.
fn serialized(
    nodes: Vec<NodeProto>,
    opset_import: Vec<OperatorSetIdProto>,
    inputs: Vec<ValueInfoProto>,
    inits: Vec<TensorProto>,
    outputs: Vec<String>,
) -> Vec<u8> {
    let g = GraphProto {
        node: nodes,
        input: inputs,
        output: outputs
            .into_iter()
            .map(|name| ValueInfoProto {
                name,
                ..Default::default()
            })
            .collect(),
        initializer: inits,
        ..Default::default()
    };
    ModelProto {
        ir_version: 8,
        opset_import,
        graph: Some(g),
        ..Default::default()
    }
    .encode_to_vec()
}

pub fn import_one_node(
    n: NodeProto,
    opset: i64,
    inputs: Vec<ValueInfoProto>,
    inits: Vec<TensorProto>,
) -> graphrun::Result<graphrun::Graph> {
    let mut opset_import = default_opset(opset);
    if !n.domain.is_empty() {
        opset_import.push(OperatorSetIdProto {
            domain: n.domain.clone(),
            version: 1,
        });
    }
    let outputs = n.output.iter().filter(|o| !o.is_empty()).cloned().collect();
    let bytes = serialized(vec![n], opset_import, inputs, inits, outputs);
    graphrun::onnx::from_bytes(&bytes, "model", std::path::Path::new("."))
}
