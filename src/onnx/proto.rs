//! The subset of onnx.proto (github.com/onnx/onnx, onnx/onnx.proto) that graphrun reads,
//! as prost messages written by hand: no protoc and no build script. Field numbers are
//! the official ones; fields graphrun does not read are left out, and prost skips them
//! while decoding. `oneof` fields are plain optional fields: a well-formed file sets at
//! most one of them, and the importer checks which.

use prost::Message;

/// ONNX `ModelProto`: a model file's top-level message.
#[derive(Clone, PartialEq, Message)]
pub struct ModelProto {
    /// `ir_version`: the version of the IR the file is written in.
    #[prost(int64, tag = "1")]
    pub ir_version: i64,
    /// `opset_import`: the operator sets (and their versions) the graph uses.
    #[prost(message, repeated, tag = "8")]
    pub opset_import: Vec<OperatorSetIdProto>,
    /// `producer_name`: the tool that wrote the file.
    #[prost(string, tag = "2")]
    pub producer_name: String,
    /// `producer_version`: that tool's version.
    #[prost(string, tag = "3")]
    pub producer_version: String,
    /// `graph`: the model's graph.
    #[prost(message, optional, tag = "7")]
    pub graph: Option<GraphProto>,
}

/// ONNX `OperatorSetIdProto`: an operator set the model imports.
#[derive(Clone, PartialEq, Message)]
pub struct OperatorSetIdProto {
    /// "" and "ai.onnx" both mean the default ONNX domain.
    #[prost(string, tag = "1")]
    pub domain: String,
    /// `version`: the operator set's version.
    #[prost(int64, tag = "2")]
    pub version: i64,
}

/// ONNX `GraphProto`: the model's graph.
#[derive(Clone, PartialEq, Message)]
pub struct GraphProto {
    /// `node`: the nodes, in topological order.
    #[prost(message, repeated, tag = "1")]
    pub node: Vec<NodeProto>,
    /// `name`: the graph's name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// `initializer`: the constant tensors (weights), by name.
    #[prost(message, repeated, tag = "5")]
    pub initializer: Vec<TensorProto>,
    /// SparseTensorProto, kept undecoded: graphrun only reports that they are there.
    #[prost(bytes = "vec", repeated, tag = "15")]
    pub sparse_initializer: Vec<Vec<u8>>,
    /// `input`: the graph inputs (in older files also the initializers).
    #[prost(message, repeated, tag = "11")]
    pub input: Vec<ValueInfoProto>,
    /// `output`: the graph outputs.
    #[prost(message, repeated, tag = "12")]
    pub output: Vec<ValueInfoProto>,
    /// Types of intermediate values, where the exporter wrote them (Einsum's ellipsis
    /// reads ranks from them).
    #[prost(message, repeated, tag = "13")]
    pub value_info: Vec<ValueInfoProto>,
}

/// ONNX `NodeProto`: one node of a graph.
#[derive(Clone, PartialEq, Message)]
pub struct NodeProto {
    /// `input`: input value names; "" marks an omitted optional input.
    #[prost(string, repeated, tag = "1")]
    pub input: Vec<String>,
    /// `output`: output value names; "" marks an output not asked for.
    #[prost(string, repeated, tag = "2")]
    pub output: Vec<String>,
    /// `name`: the node's name (may be empty).
    #[prost(string, tag = "3")]
    pub name: String,
    /// `op_type`: the operator's name (`Conv`, `MatMul`, ...).
    #[prost(string, tag = "4")]
    pub op_type: String,
    /// `domain`: the operator set the op belongs to ("" or "ai.onnx" for ONNX's own).
    #[prost(string, tag = "7")]
    pub domain: String,
    /// `attribute`: the node's attributes.
    #[prost(message, repeated, tag = "5")]
    pub attribute: Vec<AttributeProto>,
}

/// AttributeProto.AttributeType.
pub mod attr_type {
    /// `FLOAT`: a float.
    pub const FLOAT: i32 = 1;
    /// `INT`: an integer.
    pub const INT: i32 = 2;
    /// `STRING`: a string.
    pub const STRING: i32 = 3;
    /// `TENSOR`: a tensor.
    pub const TENSOR: i32 = 4;
    /// `GRAPH`: a graph.
    pub const GRAPH: i32 = 5;
    /// `FLOATS`: a list of floats.
    pub const FLOATS: i32 = 6;
    /// `INTS`: a list of integers.
    pub const INTS: i32 = 7;
    /// `STRINGS`: a list of strings.
    pub const STRINGS: i32 = 8;
    /// `TENSORS`: a list of tensors.
    pub const TENSORS: i32 = 9;
    /// `GRAPHS`: a list of graphs.
    pub const GRAPHS: i32 = 10;
    /// `SPARSE_TENSOR`: a sparse tensor.
    pub const SPARSE_TENSOR: i32 = 11;
    /// `SPARSE_TENSORS`: a list of sparse tensors.
    pub const SPARSE_TENSORS: i32 = 12;
    /// `TYPE_PROTO`: a type.
    pub const TYPE_PROTO: i32 = 13;
    /// `TYPE_PROTOS`: a list of types.
    pub const TYPE_PROTOS: i32 = 14;
}

/// ONNX `AttributeProto`: a named attribute of a node; `type` says which value field holds it.
#[derive(Clone, PartialEq, Message)]
pub struct AttributeProto {
    /// `name`: the attribute's name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Set only inside function bodies, which graphrun does not import.
    #[prost(string, tag = "21")]
    pub ref_attr_name: String,
    /// One of `attr_type`.
    #[prost(int32, tag = "20")]
    pub r#type: i32,
    /// `f`: the value of a FLOAT attribute.
    #[prost(float, tag = "2")]
    pub f: f32,
    /// `i`: the value of an INT attribute.
    #[prost(int64, tag = "3")]
    pub i: i64,
    /// `s`: the value of a STRING attribute (UTF-8 bytes).
    #[prost(bytes = "vec", tag = "4")]
    pub s: Vec<u8>,
    /// `t`: the value of a TENSOR attribute.
    #[prost(message, optional, tag = "5")]
    pub t: Option<TensorProto>,
    /// `floats`: the values of a FLOATS attribute.
    #[prost(float, repeated, tag = "7")]
    pub floats: Vec<f32>,
    /// `ints`: the values of an INTS attribute.
    #[prost(int64, repeated, tag = "8")]
    pub ints: Vec<i64>,
    /// `strings`: the values of a STRINGS attribute.
    #[prost(bytes = "vec", repeated, tag = "9")]
    pub strings: Vec<Vec<u8>>,
    /// `g`: the value of a GRAPH attribute (the body of If, Loop and Scan).
    #[prost(message, optional, boxed, tag = "6")]
    pub g: Option<Box<GraphProto>>,
    /// `graphs`: the values of a GRAPHS attribute.
    #[prost(message, repeated, tag = "11")]
    pub graphs: Vec<GraphProto>,
}

/// TensorProto.DataLocation.EXTERNAL: the data lives in a file named by `external_data`.
pub const DATA_LOCATION_EXTERNAL: i32 = 1;

/// ONNX `TensorProto`: a tensor (an initializer or a tensor attribute), its data in one of the typed fields, `raw_data`, or an external file.
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    /// `dims`: the shape.
    #[prost(int64, repeated, tag = "1")]
    pub dims: Vec<i64>,
    /// A TensorProto.DataType code (`DType::from_onnx`).
    #[prost(int32, tag = "2")]
    pub data_type: i32,
    /// `float_data`: FLOAT (and COMPLEX64) elements.
    #[prost(float, repeated, tag = "4")]
    pub float_data: Vec<f32>,
    /// INT32, and the narrower types: INT16/INT8/UINT16/UINT8/BOOL, and the bit patterns
    /// of FLOAT16/BFLOAT16.
    #[prost(int32, repeated, tag = "5")]
    pub int32_data: Vec<i32>,
    /// `string_data`: STRING elements.
    #[prost(bytes = "vec", repeated, tag = "6")]
    pub string_data: Vec<Vec<u8>>,
    /// `int64_data`: INT64 elements.
    #[prost(int64, repeated, tag = "7")]
    pub int64_data: Vec<i64>,
    /// `name`: the tensor's name (an initializer's value name).
    #[prost(string, tag = "8")]
    pub name: String,
    /// Little-endian element bytes; when set, the typed fields are empty.
    #[prost(bytes = "vec", tag = "9")]
    pub raw_data: Vec<u8>,
    /// `double_data`: DOUBLE (and COMPLEX128) elements.
    #[prost(double, repeated, tag = "10")]
    pub double_data: Vec<f64>,
    /// `uint64_data`: UINT32 and UINT64 elements.
    #[prost(uint64, repeated, tag = "11")]
    pub uint64_data: Vec<u64>,
    /// `location`, `offset`, `length` (and `checksum`) of external data.
    #[prost(message, repeated, tag = "13")]
    pub external_data: Vec<StringStringEntryProto>,
    /// `data_location`: DEFAULT (0, the data is in this message) or EXTERNAL (`DATA_LOCATION_EXTERNAL`).
    #[prost(int32, tag = "14")]
    pub data_location: i32,
}

/// ONNX `StringStringEntryProto`: a key-value pair.
#[derive(Clone, PartialEq, Message)]
pub struct StringStringEntryProto {
    /// `key`: the entry's key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// `value`: the entry's value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// ONNX `ValueInfoProto`: a value's name and type (graph inputs, outputs and `value_info`).
#[derive(Clone, PartialEq, Message)]
pub struct ValueInfoProto {
    /// `name`: the value's name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// `type`: the value's type, when the file gives it.
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<TypeProto>,
}

/// TypeProto's `value` oneof: graphrun takes tensors; the other kinds (sequence 4, map 5,
/// sparse tensor 8, optional 9) are kept undecoded so that they can be named in errors.
#[derive(Clone, PartialEq, Message)]
pub struct TypeProto {
    /// `tensor_type`: set for a tensor.
    #[prost(message, optional, tag = "1")]
    pub tensor_type: Option<TypeProtoTensor>,
    /// `sequence_type`: set for a sequence (undecoded).
    #[prost(bytes = "vec", optional, tag = "4")]
    pub sequence_type: Option<Vec<u8>>,
    /// `map_type`: set for a map (undecoded).
    #[prost(bytes = "vec", optional, tag = "5")]
    pub map_type: Option<Vec<u8>>,
    /// `sparse_tensor_type`: set for a sparse tensor (undecoded).
    #[prost(bytes = "vec", optional, tag = "8")]
    pub sparse_tensor_type: Option<Vec<u8>>,
    /// `optional_type`: set for an optional (undecoded).
    #[prost(bytes = "vec", optional, tag = "9")]
    pub optional_type: Option<Vec<u8>>,
}

/// ONNX `TypeProto.Optional`: an optional's element type.
#[derive(Clone, PartialEq, Message)]
pub struct TypeProtoOptional {
    /// `elem_type`: the type of the element.
    #[prost(message, optional, boxed, tag = "1")]
    pub elem_type: Option<Box<TypeProto>>,
}

/// ONNX `TypeProto.Sequence`: a sequence's element type.
#[derive(Clone, PartialEq, Message)]
pub struct TypeProtoSequence {
    /// `elem_type`: the type of the elements.
    #[prost(message, optional, boxed, tag = "1")]
    pub elem_type: Option<Box<TypeProto>>,
}

impl TypeProto {
    /// The element tensor type of a sequence of tensors, or of an optional that holds
    /// one; `Some(None)` where the elements' type is not a tensor's.
    pub fn sequence_of(&self) -> Option<Option<TypeProtoTensor>> {
        let bytes = match &self.sequence_type {
            Some(b) => b.clone(),
            None => {
                let o = TypeProtoOptional::decode(self.optional_type.as_deref()?).ok()?;
                o.elem_type?.sequence_type?
            }
        };
        let s = TypeProtoSequence::decode(bytes.as_slice()).ok()?;
        Some(s.elem_type.and_then(|t| t.tensor()))
    }

    /// The tensor type of a tensor, or of an optional that holds a tensor (which graphrun
    /// takes as its tensor, see `onnx::nodes::optional`).
    pub fn tensor(&self) -> Option<TypeProtoTensor> {
        if let Some(t) = &self.tensor_type {
            return Some(t.clone());
        }
        let o = TypeProtoOptional::decode(self.optional_type.as_deref()?).ok()?;
        o.elem_type?.tensor_type
    }
}

/// ONNX `TypeProto.Tensor`: a tensor type, its element type and shape.
#[derive(Clone, PartialEq, Message)]
pub struct TypeProtoTensor {
    /// `elem_type`: the element type, a TensorProto.DataType code.
    #[prost(int32, tag = "1")]
    pub elem_type: i32,
    /// Absent when even the rank is unknown.
    #[prost(message, optional, tag = "2")]
    pub shape: Option<TensorShapeProto>,
}

/// ONNX `TensorShapeProto`: a shape, one entry per axis.
#[derive(Clone, PartialEq, Message)]
pub struct TensorShapeProto {
    /// `dim`: each axis's size.
    #[prost(message, repeated, tag = "1")]
    pub dim: Vec<Dimension>,
}

/// One dim: a size, a symbol, or neither (unknown).
#[derive(Clone, PartialEq, Message)]
pub struct Dimension {
    /// `dim_value`: a fixed size.
    #[prost(int64, optional, tag = "1")]
    pub dim_value: Option<i64>,
    /// `dim_param`: a symbolic size, by name.
    #[prost(string, optional, tag = "2")]
    pub dim_param: Option<String>,
}
