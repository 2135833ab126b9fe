//! Trained weights written back into the ONNX file they were trained from
//! (`graphrun convert MODEL.onnx --weights TRAINED.safetensors -o OUT.onnx`).

use super::import::{copies, looks_trainable};
use super::proto::{ModelProto, TensorProto};
use super::tensor::from_proto;
use crate::error::{Error, Result};
use crate::tensor::{fmt_shape, Tensor};
use prost::Message;
use std::collections::HashMap;
use std::path::Path;

/// What `with_weights` wrote.
#[derive(Clone, Debug, Default)]
pub struct Written {
    /// Initializers given a value of the same name.
    pub replaced: usize,
    /// Values the file holds in another form, written in it: an exported copy of a
    /// weight (its transpose, folded), and running statistics an Identity node gave
    /// (the node becomes an initializer).
    pub derived: Vec<String>,
    /// Weights with no place in the file (a statistic the training import gave an
    /// initializer of its own where the file shares one), not written.
    pub left_out: Vec<String>,
}

/// `model` (a serialized ModelProto whose external data lies in `base`) with the values
/// of `weights` in place of its initializers', matched by name, each of the same type.
/// Every initializer is written inline, so the result stands alone.
pub fn with_weights(
    model: &[u8],
    base: &Path,
    weights: &[(String, Tensor)],
) -> Result<(Vec<u8>, Written)> {
    let mut m = ModelProto::decode(model).map_err(|e| {
        Error::Graph(format!(
            "not a valid ONNX model (protobuf decoding failed: {e})"
        ))
    })?;
    let Some(g) = m.graph.as_mut() else {
        return Err(Error::Graph("the model has no graph".into()));
    };
    let by_name: HashMap<&str, &Tensor> = weights.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut done = Written::default();
    let mut used: Vec<&str> = vec![];
    let originals: Vec<Tensor> = g
        .initializer
        .iter()
        .map(|t| from_proto(t, base, &format!("initializer '{}'", t.name)))
        .collect::<Result<_>>()?;
    // An exported copy of a trained weight takes the weight's new value.
    let listed: Vec<(&str, &Tensor, bool)> = g
        .initializer
        .iter()
        .zip(&originals)
        .map(|(t, v)| (t.name.as_str(), v, looks_trainable(v)))
        .collect();
    let mut derived: HashMap<usize, Tensor> = HashMap::new();
    for (copy, kept, transposed) in copies(&listed) {
        let (name, from) = (listed[copy].0, listed[kept].0);
        if by_name.contains_key(name) {
            continue;
        }
        if let Some(w) = by_name.get(from) {
            let v = if transposed {
                transpose(w)?
            } else {
                (*w).clone()
            };
            derived.insert(copy, v);
            done.derived.push(name.to_string());
        }
    }
    for (k, t) in g.initializer.iter_mut().enumerate() {
        let new = match (by_name.get(t.name.as_str()), derived.remove(&k)) {
            (Some(w), _) => {
                used.push(
                    &weights
                        .iter()
                        .find(|(n, _)| *n == t.name)
                        .expect("by name")
                        .0,
                );
                done.replaced += 1;
                Some((*w).clone())
            }
            (None, d) => d,
        };
        let value = match new {
            Some(v) => {
                let old = &originals[k];
                if v.dtype() != old.dtype() || v.shape() != old.shape() {
                    return Err(Error::Input(format!(
                        "weight '{}' is {}{}, but the model's initializer is {}{}",
                        t.name,
                        v.dtype(),
                        fmt_shape(v.shape()),
                        old.dtype(),
                        fmt_shape(old.shape())
                    )));
                }
                v
            }
            None => originals[k].clone(),
        };
        *t = proto_of(&t.name, &value);
    }
    // Running statistics that an Identity gave: the Identity becomes an initializer.
    for (name, w) in weights {
        if used.contains(&name.as_str()) {
            continue;
        }
        let identity = g
            .node
            .iter()
            .position(|n| n.op_type == "Identity" && n.output.first().is_some_and(|o| o == name));
        match identity {
            Some(j) => {
                g.node.remove(j);
                g.initializer.push(proto_of(name, w));
                done.derived.push(name.clone());
            }
            None => done.left_out.push(name.clone()),
        }
    }
    Ok((m.encode_to_vec(), done))
}

/// An initializer holding `t` as raw data.
fn proto_of(name: &str, t: &Tensor) -> TensorProto {
    TensorProto {
        name: name.to_string(),
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: t.dtype().onnx_code(),
        raw_data: match t.dtype().narrow_bits() {
            Some(_) => crate::tensor::narrow::pack(t.dtype(), t.bytes()),
            None => t.bytes().to_vec(),
        },
        ..Default::default()
    }
}

/// A 2-D tensor transposed.
fn transpose(t: &Tensor) -> Result<Tensor> {
    let (r, c) = (t.shape()[0], t.shape()[1]);
    let size = t.dtype().size();
    let src = t.bytes();
    let mut out = vec![0u8; src.len()];
    for i in 0..r {
        for j in 0..c {
            let (a, b) = ((i * c + j) * size, (j * r + i) * size);
            out[b..b + size].copy_from_slice(&src[a..a + size]);
        }
    }
    Tensor::from_bytes(t.dtype(), &[c, r], &out)
}
