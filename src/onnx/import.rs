//! ModelProto → `Graph`: the opset, initializers and graph inputs; the nodes are
//! converted by `nodes.rs`.

use super::nodes::Importer;
use super::proto::{ModelProto, ValueInfoProto};
use super::tensor::{dtype_of, from_proto};
use super::{MAX_OPSET, MIN_OPSET};
use crate::error::{Error, Result};
use crate::graph::{Dim, Graph, InitSource, Initializer, InputInfo};
use crate::tensor::Tensor;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// The ai.onnx opset a model imports; other domains are checked per node.
fn default_opset(m: &ModelProto) -> Result<i64> {
    let mut found = None;
    for o in &m.opset_import {
        if o.domain.is_empty() || o.domain == "ai.onnx" {
            found = Some(found.map_or(o.version, |v: i64| v.max(o.version)));
        }
    }
    let Some(v) = found else {
        return Err(Error::Graph(
            "the model imports no ai.onnx opset (opset_import has no entry for the default domain)"
                .into(),
        ));
    };
    if !(MIN_OPSET..=MAX_OPSET).contains(&v) {
        return Err(Error::Graph(format!(
            "the model imports ai.onnx opset {v}; graphrun implements opsets {MIN_OPSET} to {MAX_OPSET}"
        )));
    }
    Ok(v)
}

pub(super) fn graph_of(m: &ModelProto, stem: &str, base: &Path) -> Result<Graph> {
    let opset = default_opset(m)?;
    let Some(gp) = &m.graph else {
        return Err(Error::Graph("the model has no graph".into()));
    };
    if !gp.sparse_initializer.is_empty() {
        return Err(Error::Graph(format!(
            "the graph has {} sparse initializers; graphrun reads dense initializers only",
            gp.sparse_initializer.len()
        )));
    }
    // From IR version 4 on, an initializer that is also a graph input is that input's
    // default, which a caller may override (ONNX Runtime's rule); before it, every
    // initializer had to be listed as an input too, and is a constant.
    let input_names: HashSet<&str> = gp.input.iter().map(|i| i.name.as_str()).collect();
    let defaults_are_inputs = m.ir_version >= 4;
    let mut initializers = vec![];
    let mut defaults: HashMap<&str, Tensor> = HashMap::new();
    for t in &gp.initializer {
        let tensor = from_proto(t, base, &format!("initializer '{}'", t.name))?;
        if defaults_are_inputs && input_names.contains(t.name.as_str()) {
            defaults.insert(t.name.as_str(), tensor);
            continue;
        }
        initializers.push(Initializer {
            name: t.name.clone(),
            trainable: looks_trainable(&tensor),
            tensor,
            source: InitSource::Data,
            loc: None,
        });
    }
    // BatchNormalization's running mean and variance are statistics, not weights: a
    // gradient step must not move them.
    let stats: HashSet<&str> = gp
        .node
        .iter()
        .filter(|n| n.op_type == "BatchNormalization" && n.domain.is_empty())
        .flat_map(|n| n.input.iter().skip(3).take(2))
        .map(String::as_str)
        .collect();
    for i in &mut initializers {
        if stats.contains(i.name.as_str()) {
            i.trainable = false;
        }
    }
    let init_names: HashSet<&str> = gp.initializer.iter().map(|t| t.name.as_str()).collect();
    let mut inputs = vec![];
    for vi in &gp.input {
        if let Some(t) = defaults.remove(vi.name.as_str()) {
            let mut i = input_info(vi)?;
            let fits = t.dtype() == i.dtype
                && t.shape().len() == i.shape.len()
                && i.shape
                    .iter()
                    .zip(t.shape())
                    .all(|(d, &n)| matches!(d, Dim::Sym(_)) || *d == Dim::Fixed(n));
            if !fits {
                return Err(Error::Graph(format!(
                    "graph input '{}' has the initializer {} {} as its default, which does not fit its type",
                    vi.name,
                    t.dtype(),
                    crate::tensor::fmt_shape(t.shape())
                )));
            }
            i.default = Some(t);
            inputs.push(i);
        } else if !init_names.contains(vi.name.as_str()) {
            inputs.push(input_info(vi)?);
        }
    }
    let mut im = Importer::new(gp, opset, base);
    for (i, n) in gp.node.iter().enumerate() {
        im.node(i, n);
    }
    let nodes = im.finish()?;
    let mut g = Graph {
        name: if gp.name.is_empty() {
            stem.to_string()
        } else {
            gp.name.clone()
        },
        dims: BTreeMap::new(),
        inputs,
        outputs: gp.output.iter().map(|o| o.name.clone()).collect(),
        initializers,
        nodes,
        training: None,
        file: None,
    };
    crate::graph::yaml::name_nodes(&mut g);
    Ok(g)
}

/// Magnitudes from here on are masking values (-inf, float's lowest, -1e9, -1e4), not
/// weights.
const MASK_MAGNITUDE: f64 = 1e4;

/// ONNX has no trainable flag, and exporters write constants as initializers too. A
/// floating initializer is taken for a weight unless it has one element (the scale and
/// epsilon constants exporters write) or holds a masking value (an additive attention
/// mask, which training must not change). `convert` writes the choice as `trainable:`,
/// for a user to change.
fn looks_trainable(t: &Tensor) -> bool {
    t.dtype().is_float() && t.numel() > 1 && t.to_f64_vec().iter().all(|v| v.abs() < MASK_MAGNITUDE)
}

fn input_info(vi: &ValueInfoProto) -> Result<InputInfo> {
    let what = format!("graph input '{}'", vi.name);
    let ty = vi.r#type.as_ref();
    let Some(tt) = ty.and_then(|t| t.tensor_type.as_ref()) else {
        let kind = match ty {
            None => "no type",
            Some(t) if t.sequence_type.is_some() => "a sequence type",
            Some(t) if t.map_type.is_some() => "a map type",
            Some(t) if t.sparse_tensor_type.is_some() => "a sparse tensor type",
            Some(t) if t.optional_type.is_some() => "an optional type",
            Some(_) => "an unknown type",
        };
        return Err(Error::Graph(format!(
            "{what} has {kind}; graphrun takes dense tensors"
        )));
    };
    let dtype = dtype_of(tt.elem_type as i64, &what)?;
    let Some(shape) = &tt.shape else {
        return Err(Error::Graph(format!(
            "{what} has no shape; graphrun needs the rank of every input"
        )));
    };
    let mut dims = vec![];
    for (k, d) in shape.dim.iter().enumerate() {
        dims.push(match (d.dim_value, d.dim_param.as_deref()) {
            (Some(v), _) => Dim::Fixed(usize::try_from(v).map_err(|_| {
                Error::Graph(format!("{what}: dim {k} is {v}; sizes cannot be negative"))
            })?),
            (None, Some(p)) if !p.is_empty() => Dim::Sym(symbol(p)),
            // An unknown dim gets a symbol of its own, bound when the input is fed.
            _ => Dim::Sym(symbol(&format!("{}_dim{k}", vi.name))),
        });
    }
    Ok(InputInfo {
        default: None,
        name: vi.name.clone(),
        dtype,
        shape: dims,
        range: None,
        loc: None,
    })
}

/// A dim_param as a graphrun symbol (an identifier, as the YAML format needs): other
/// characters become '_' ("batch size" → "batch_size", "N+1" → "N_1").
fn symbol(p: &str) -> String {
    let mut s: String = p
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if !s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
        s.insert(0, '_');
    }
    s
}
