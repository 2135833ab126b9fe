//! `.onnx` import: a ModelProto file becomes the same `Graph` a YAML model gives, so that
//! every command and library call takes either (`Model::load` dispatches on the
//! extension). `graphrun convert` writes the YAML form.
//!
//! What is read: the ai.onnx opset (7 to 27; 1 to 6 for the ops whose definition did
//! not change until after opset 7, see `OLDEST_OPSET`), initializers from raw_data, the typed fields or
//! external data files, graph inputs with their dims (dim_param → a symbol), Constant
//! nodes, and nodes of the ops in SPEC §2. Subgraphs, functions, sparse tensors and other
//! domains are refused with an error that names them.

mod import;
mod nodes;
pub mod proto;
mod write;

pub use import::{ImportMode, ImportOptions};
pub use nodes::{element_name, imports, imports_in, YamlLowering};
pub use write::{with_weights, Written};
pub mod tensor;

use crate::error::{Error, Result};
use crate::graph::{validate, Graph};
use crate::tensor::Tensor;
use prost::Message;
use std::path::Path;

/// The ai.onnx opsets graphrun implements. Below 7, the elementwise ops broadcast only
/// with an explicit attribute; opsets 24 to 27 only widened the dtypes of ops graphrun runs
/// (new dtypes are refused by name), added Swish and the float16 Range, and gave Attention
/// the nonpad_kv_seqlen input (imported with the KV-cache form, as its definition).
pub const MIN_OPSET: i64 = 7;
/// The oldest ai.onnx opset a model may import. Under opsets 1 to 6 the importer takes
/// only the ops whose definition then is the one opset 7 has (Not, Conv, MatMul, the
/// reductions, ...); the others (the elementwise ops' `broadcast` attribute, the
/// `consumed_inputs` of opsets 1 to 5, ...) are refused by node.
pub const OLDEST_OPSET: i64 = 1;
/// The newest ai.onnx opset graphrun implements (see `MIN_OPSET`).
pub const MAX_OPSET: i64 = 27;

/// Whether `path` names an ONNX file (by its extension).
pub fn is_onnx_path(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
}

/// Loads and validates an .onnx model; external data files are read from its folder.
pub fn load(path: &Path) -> Result<Graph> {
    load_with(path, &ImportOptions::default())
}

/// `load`, imported as `opts` says (for training, say).
pub fn load_with(path: &Path, opts: &ImportOptions) -> Result<Graph> {
    let bytes = crate::files::read_bytes(path, "the model")?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut g = from_bytes_with(&bytes, &stem, &base, opts).map_err(|e| in_file(path, e))?;
    g.file = Some(path.to_path_buf());
    Ok(g)
}

/// Decodes, imports and validates a serialized ModelProto. `stem` names the graph when
/// the model gives it no name; `base` is the folder of external data files.
pub fn from_bytes(bytes: &[u8], stem: &str, base: &Path) -> Result<Graph> {
    from_bytes_with(bytes, stem, base, &ImportOptions::default())
}

/// `from_bytes`, imported as `opts` says.
pub fn from_bytes_with(
    bytes: &[u8],
    stem: &str,
    base: &Path,
    opts: &ImportOptions,
) -> Result<Graph> {
    let m = proto::ModelProto::decode(bytes).map_err(|e| {
        Error::Graph(format!(
            "not a valid ONNX model (protobuf decoding failed: {e})"
        ))
    })?;
    let g = import::graph_of(&m, stem, base, opts)?;
    validate::validate(&g, &crate::backends::cpu::HOST_EVAL)?;
    Ok(g)
}

/// Reads a file holding one serialized TensorProto (ONNX's test data `input_0.pb`); returns
/// its name (possibly empty) and value.
pub fn read_tensor(path: &Path) -> Result<(String, Tensor)> {
    let bytes = crate::files::read_bytes(path, "a TensorProto")?;
    let t = proto::TensorProto::decode(bytes.as_slice())
        .map_err(|e| Error::io(path, format!("not a serialized ONNX TensorProto: {e}")))?;
    let base = path.parent().unwrap_or(Path::new("."));
    let value = tensor::from_proto(&t, base, &format!("tensor '{}'", t.name))
        .map_err(|e| in_file(path, e))?;
    Ok((t.name, value))
}

/// Prefixes graph errors with the file they came from (the YAML loader's errors carry
/// file:line:col; an ONNX file has no lines to point at).
fn in_file(path: &Path, e: Error) -> Error {
    match e {
        Error::Graph(m) => Error::Graph(format!("{}: {m}", path.display())),
        Error::Many(v) => Error::Many(v.into_iter().map(|e| in_file(path, e)).collect()),
        other => other,
    }
}
