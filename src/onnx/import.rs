//! ModelProto → `Graph`: the opset, initializers and graph inputs; the nodes are
//! converted by `nodes.rs`.

use super::nodes::{element_name, Importer};
use super::proto::{ModelProto, NodeProto, TypeProtoTensor, ValueInfoProto};
use super::tensor::{dtype_of, from_proto};
use super::{MAX_OPSET, OLDEST_OPSET};
use crate::error::{Error, Result};
use crate::graph::{Dim, Graph, InitSource, Initializer, InputInfo, StateUpdate};
use crate::tensor::Tensor;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// The ai.onnx opset a model imports; other domains are checked per node. A model whose
/// nodes are all of other domains (ai.onnx.ml, ai.onnx.preview.training) need not import
/// one.
fn default_opset(m: &ModelProto) -> Result<i64> {
    let mut found = None;
    for o in &m.opset_import {
        if o.domain.is_empty() || o.domain == "ai.onnx" {
            found = Some(found.map_or(o.version, |v: i64| v.max(o.version)));
        }
    }
    let default_nodes = m.graph.as_ref().is_some_and(|g| {
        g.node
            .iter()
            .any(|n| n.domain.is_empty() || n.domain == "ai.onnx")
    });
    let Some(v) = found.or((!default_nodes).then_some(MAX_OPSET)) else {
        return Err(Error::Graph(
            "the model imports no ai.onnx opset (opset_import has no entry for the default domain)"
                .into(),
        ));
    };
    if !(OLDEST_OPSET..=MAX_OPSET).contains(&v) {
        return Err(Error::Graph(format!(
            "the model imports ai.onnx opset {v}; graphrun implements opsets {OLDEST_OPSET} to {MAX_OPSET}"
        )));
    }
    Ok(v)
}

/// How a model is imported.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// Which mode BatchNormalization runs in.
    pub mode: ImportMode,
    /// Sizes of symbolic input dims, by symbol. Read only where the import needs a size
    /// that a symbol decides: a recurrence (RNN, GRU, LSTM) is unrolled when it is
    /// imported, so its sequence length must be known then. A model with such a
    /// recurrence is imported with these symbols (and those `input_shapes` size) fixed.
    pub dims: BTreeMap<String, usize>,
    /// The shapes the caller will feed, by input name: they size the symbols of the
    /// inputs' declared shapes as `dims` does.
    pub input_shapes: BTreeMap<String, Vec<usize>>,
}

/// The mode of the layers whose training and inference forms differ (BatchNormalization),
/// as PyTorch's `train()` and `eval()` set it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ImportMode {
    /// As the file writes each node (`training_mode`).
    #[default]
    AsWritten,
    /// For training: every BatchNormalization normalizes by the batch's statistics, and
    /// one whose running mean and variance come from initializers moves them after each
    /// training step (`Graph::updates`): momentum · running + (1 − momentum) · batch. A
    /// node written in inference form moves the running variance towards the unbiased
    /// batch variance, as PyTorch does; one written with training_mode = 1 towards the
    /// biased one, as ONNX defines it.
    Train,
    /// For evaluating what `Train` trained: every BatchNormalization normalizes by its
    /// running statistics, which have initializers of their own named as `Train` names
    /// them, so that a trained model's values carry over by name.
    Eval,
}

pub(super) fn graph_of(
    m: &ModelProto,
    stem: &str,
    base: &Path,
    opts: &ImportOptions,
) -> Result<Graph> {
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
    let mut seq_inputs = vec![];
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
        } else if let Some(elem) = vi.r#type.as_ref().and_then(|t| t.sequence_of()) {
            let items = sequence_input(vi, elem, opts)?;
            seq_inputs.push((
                vi.name.clone(),
                items.iter().map(|i| i.name.clone()).collect(),
            ));
            inputs.extend(items);
        } else if !init_names.contains(vi.name.as_str()) {
            inputs.push(input_info(vi)?);
        }
    }
    let mut im = Importer::new(gp, opset, base);
    im.seqs.extend(seq_inputs);
    let mut outputs: Vec<String> = gp.output.iter().map(|o| o.name.clone()).collect();
    let mut updates = vec![];
    let mut protos = std::borrow::Cow::Borrowed(&gp.node);
    if opts.mode != ImportMode::AsWritten {
        im.batch_norm_mode = Some(opts.mode == ImportMode::Train);
        updates = bind_batch_norm_state(
            &mut im,
            protos.to_mut(),
            &mut initializers,
            &outputs,
            opts.mode == ImportMode::Train,
        );
        outputs.extend(updates.iter().map(|u| u.value.clone()));
    }
    for (i, n) in protos.iter().enumerate() {
        im.node(i, n);
    }
    let outputs = im.sequence_outputs(&outputs);
    let deferred = std::mem::take(&mut im.deferred);
    let graphs = std::mem::take(&mut im.graphs);
    let nodes = im.finish()?;
    let mut g = Graph {
        name: if gp.name.is_empty() {
            stem.to_string()
        } else {
            gp.name.clone()
        },
        dims: BTreeMap::new(),
        inputs,
        outputs,
        initializers,
        nodes,
        training: None,
        updates,
        file: None,
    };
    if !deferred.is_empty() {
        bind_symbols(&mut g, opts);
        crate::graph::lower::lower_all(
            &mut g,
            &deferred,
            &super::nodes::Deferred {
                opset,
                base,
                graphs: graphs.into(),
            },
            &crate::backends::cpu::HOST_EVAL,
        )?;
    }
    crate::graph::infer::freeze_shape_deciding(&mut g);
    if opts.mode != ImportMode::AsWritten {
        tie_copies(&mut g);
    }
    unique_node_names(&mut g);
    crate::graph::yaml::name_nodes(&mut g);
    Ok(g)
}

/// ONNX lets nodes share a name (a label only; ONNX Runtime runs such files), while
/// graphrun's node names identify nodes: a name met again gets the first free suffix.
fn unique_node_names(g: &mut Graph) {
    let mut taken: HashSet<String> = HashSet::new();
    let names: HashSet<String> = g.nodes.iter().map(|n| n.name.clone()).collect();
    for n in g.nodes.iter_mut().filter(|n| !n.name.is_empty()) {
        if taken.insert(n.name.clone()) {
            continue;
        }
        let mut k = 1;
        let name = loop {
            let c = format!("{}_{k}", n.name);
            if !names.contains(&c) && !taken.contains(&c) {
                break c;
            }
            k += 1;
        };
        taken.insert(name.clone());
        n.name = name;
    }
}

/// Fixes the symbolic dims of the graph inputs that `opts` sizes (by symbol, or by the
/// shape the caller will feed).
fn bind_symbols(g: &mut Graph, opts: &ImportOptions) {
    let mut sizes = opts.dims.clone();
    for i in &g.inputs {
        let Some(s) = opts
            .input_shapes
            .get(&i.name)
            .filter(|s| s.len() == i.shape.len())
        else {
            continue;
        };
        for (d, &n) in i.shape.iter().zip(s) {
            if let Dim::Sym(k) = d {
                sizes.entry(k.clone()).or_insert(n);
            }
        }
    }
    // Kept as the symbols' defaults, so that a later `--dim` naming one still names a
    // dim of the model.
    for (k, &n) in &sizes {
        if g.inputs
            .iter()
            .any(|i| i.shape.contains(&Dim::Sym(k.clone())))
        {
            g.dims.insert(k.clone(), n);
        }
    }
    for i in &mut g.inputs {
        for d in &mut i.shape {
            if let Some(&n) = match d {
                Dim::Sym(k) => sizes.get(k),
                Dim::Fixed(_) => None,
            } {
                *d = Dim::Fixed(n);
            }
        }
    }
}

/// For training (`ImportOptions::training`): gives the running mean and variance of each
/// BatchNormalization an initializer of its own and names the node's running-statistics
/// outputs, returning the state updates that write those outputs back. A statistic that
/// is an initializer nothing else reads is used as it is; one that an exporter shares
/// with other values (the TorchScript exporter deduplicates a fresh BN's ones and zeros
/// into the weight and bias, through Identity nodes) gets a copy, named as the
/// BatchNormalization reads it where the Identity giving it can go. A statistic that no
/// initializer gives (one computed by nodes) is not updated. Not `training` (for eval),
/// only the initializers are made, and running-statistics outputs that nothing reads go.
fn bind_batch_norm_state(
    im: &mut Importer,
    nodes: &mut Vec<NodeProto>,
    inits: &mut Vec<Initializer>,
    outputs: &[String],
    training: bool,
) -> Vec<StateUpdate> {
    let is_bn = |n: &NodeProto| {
        n.op_type == "BatchNormalization"
            && (n.domain.is_empty() || n.domain == "ai.onnx")
            && n.input.len() >= 5
    };
    let readers = |nodes: &[NodeProto], v: &str| {
        nodes
            .iter()
            .flat_map(|m| m.input.iter())
            .filter(|i| *i == v)
            .count()
    };
    let identity_of = |nodes: &[NodeProto], v: &str| {
        nodes
            .iter()
            .position(|m| m.op_type == "Identity" && m.output.first().is_some_and(|o| o == v))
    };
    // The initializer a value is, through Identity nodes.
    let source = |nodes: &[NodeProto], inits: &[Initializer], v: &str| {
        let mut v = v.to_string();
        loop {
            if let Some(i) = inits.iter().find(|i| i.name == v) {
                return Some(i.tensor.clone());
            }
            v = nodes[identity_of(nodes, &v)?].input.first()?.clone();
        }
    };
    let add = |im: &mut Importer, inits: &mut Vec<Initializer>, name: &str, tensor: Tensor| {
        im.declare(name, &tensor);
        inits.push(Initializer {
            name: name.to_string(),
            tensor,
            trainable: false,
            source: InitSource::Data,
            loc: None,
        });
    };
    // First the statistics an Identity gives to this node alone: the Identity goes, and an
    // initializer takes its output's name. What it read may then be read by one node only.
    let mut bi = 0;
    while bi < nodes.len() {
        for k in [3, 4] {
            if !is_bn(&nodes[bi]) {
                break;
            }
            let v = nodes[bi].input[k].clone();
            let alone = readers(nodes, &v) == 1 && !outputs.contains(&v);
            let Some(j) = identity_of(nodes, &v).filter(|_| alone) else {
                continue;
            };
            let Some(t) = source(nodes, inits, &v) else {
                continue;
            };
            nodes.remove(j);
            bi -= usize::from(j < bi);
            add(im, inits, &v, t);
        }
        bi += 1;
    }
    // Then every statistic: an initializer read by this node alone is used as it is;
    // anything else that an initializer gives gets a copy of its own.
    let mut updates = vec![];
    for bi in 0..nodes.len() {
        if !is_bn(&nodes[bi]) {
            continue;
        }
        let mut targets = vec![];
        for k in [3, 4] {
            let v = nodes[bi].input[k].clone();
            let alone = readers(nodes, &v) == 1 && !outputs.contains(&v);
            if alone && inits.iter().any(|i| i.name == v && !i.trainable) {
                targets.push(v);
                continue;
            }
            let Some(t) = source(nodes, inits, &v) else {
                break;
            };
            let name = im.fresh(&format!("{v}.state"));
            add(im, inits, &name, t);
            nodes[bi].input[k] = name.clone();
            targets.push(name);
        }
        if !training {
            let n = &mut nodes[bi];
            let unread: Vec<bool> = n.output.iter().map(|o| !outputs.contains(o)).collect();
            let read_by_nodes = |o: &str| readers(nodes, o) > 0;
            let keep: Vec<String> = nodes[bi]
                .output
                .iter()
                .enumerate()
                .map(|(k, o)| {
                    if k == 0 || !unread[k] || read_by_nodes(o) {
                        o.clone()
                    } else {
                        String::new()
                    }
                })
                .collect();
            nodes[bi].output = keep;
            while nodes[bi].output.last().is_some_and(|o| o.is_empty()) {
                nodes[bi].output.pop();
            }
            continue;
        }
        if targets.len() == 2 {
            let n = &mut nodes[bi];
            n.output.resize(3, String::new());
            for (k, target) in [(1, &targets[0]), (2, &targets[1])] {
                if n.output[k].is_empty() {
                    n.output[k] = im.fresh(&format!("{target}.next"));
                }
                updates.push(StateUpdate {
                    target: target.clone(),
                    value: n.output[k].clone(),
                });
            }
        }
    }
    updates
}

/// For training: ties the copies an exporter made of one parameter back to it. A model
/// whose embedding and output projection share a weight (GPT-2's) exports as two
/// initializers, the weight and its transpose folded into a constant, which training
/// would then move apart. A trainable 2-D initializer that equals another's transpose
/// (or another, same shape) element for element, with at least two distinct values (so
/// that fresh zeros or ones are not taken for copies), becomes a Transpose (or Identity)
/// of it; the one kept is the one named as a parameter (not `val_…`, `onnx::…`).
fn tie_copies(g: &mut Graph) {
    let tied = copies(
        &g.initializers
            .iter()
            .map(|i| (i.name.as_str(), &i.tensor, i.trainable))
            .collect::<Vec<_>>(),
    );
    for &(copy, kept, transposed) in &tied {
        let (name, from) = (
            g.initializers[copy].name.clone(),
            g.initializers[kept].name.clone(),
        );
        g.nodes.push(crate::graph::Node {
            name: format!("{name}/tied"),
            op: if transposed {
                crate::graph::Op::Transpose {
                    perm: Some(vec![1, 0]),
                }
            } else {
                crate::graph::Op::Identity
            },
            inputs: vec![from],
            outputs: vec![name],
            loc: None,
        });
    }
    let copies: HashSet<usize> = tied.iter().map(|t| t.0).collect();
    let mut k = 0;
    g.initializers.retain(|_| {
        k += 1;
        !copies.contains(&(k - 1))
    });
}

/// The copies among initializers (name, value, trainable), as `tie_copies` takes them:
/// (copy, the one it copies, whether transposed), by index.
pub(super) fn copies(inits: &[(&str, &Tensor, bool)]) -> Vec<(usize, usize, bool)> {
    let generated =
        |n: &str| n.starts_with("val_") || n.starts_with("onnx::") || n.starts_with('_');
    // Compared by their bytes (same dtype: equal values are equal bytes), the shapes
    // first, so that a large model's weights are read only against the few that fit.
    fn elem(t: &Tensor, k: usize) -> &[u8] {
        let z = t.dtype().size();
        &t.bytes()[k * z..(k + 1) * z]
    }
    let candidates: Vec<usize> = (0..inits.len())
        .filter(|&k| {
            let (_, t, trainable) = inits[k];
            trainable && t.shape().len() == 2 && (1..t.numel()).any(|i| elem(t, i) != elem(t, 0))
        })
        .collect();
    let mut tied: Vec<(usize, usize, bool)> = vec![];
    for (a, &p) in candidates.iter().enumerate() {
        for &q in &candidates[a + 1..] {
            let ((np, tp, _), (nq, tq, _)) = (inits[p], inits[q]);
            let (sp, sq) = (tp.shape(), tq.shape());
            let fits = sp == sq || (sp[0] == sq[1] && sp[1] == sq[0]);
            if !fits || tp.dtype() != tq.dtype() || tied.iter().any(|t| t.0 == p || t.0 == q) {
                continue;
            }
            let same = sp == sq && tp.bytes() == tq.bytes();
            let transposed = !same
                && sp[0] == sq[1]
                && sp[1] == sq[0]
                && (0..sp[0]).all(|r| {
                    (0..sp[1]).all(|c| elem(tp, r * sp[1] + c) == elem(tq, c * sp[0] + r))
                });
            if !same && !transposed {
                continue;
            }
            let (copy, kept) = if generated(np) && !generated(nq) {
                (p, q)
            } else {
                (q, p)
            };
            tied.push((copy, kept, transposed));
        }
    }
    tied
}

/// Magnitudes from here on are masking values (-inf, float's lowest, -1e9, -1e4), not
/// weights.
const MASK_MAGNITUDE: f64 = 1e4;

/// ONNX has no trainable flag, and exporters write constants as initializers too. A
/// floating initializer is taken for a weight unless it has one element (the scale and
/// epsilon constants exporters write) or holds a masking value (an additive attention
/// mask, which training must not change). `convert` writes the choice as `trainable:`,
/// for a user to change.
pub(super) fn looks_trainable(t: &Tensor) -> bool {
    t.dtype().is_float() && t.numel() > 1 && t.to_f64_vec().iter().all(|v| v.abs() < MASK_MAGNITUDE)
}

fn input_info(vi: &ValueInfoProto) -> Result<InputInfo> {
    let what = format!("graph input '{}'", vi.name);
    let ty = vi.r#type.as_ref();
    let Some(tt) = ty.and_then(|t| t.tensor()) else {
        let kind = match ty {
            None => "no type",
            Some(t) if t.sequence_type.is_some() => "a sequence type",
            Some(t) if t.map_type.is_some() => "a map type",
            Some(t) if t.sparse_tensor_type.is_some() => "a sparse tensor type",
            Some(t) if t.optional_type.is_some() => {
                "an optional type whose element is not a tensor"
            }
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

/// The elements of a graph input of a sequence type: the inputs `name[0]`, `name[1]`,
/// ..., as many as the caller will feed (`ImportOptions::input_shapes`), each of the
/// sequence's element type and the shape it will be fed with.
fn sequence_input(
    vi: &ValueInfoProto,
    elem: Option<TypeProtoTensor>,
    opts: &ImportOptions,
) -> Result<Vec<InputInfo>> {
    let what = format!("graph input '{}'", vi.name);
    let Some(elem) = elem else {
        return Err(Error::Graph(format!(
            "{what} is a sequence whose elements are not tensors; graphrun takes sequences of tensors"
        )));
    };
    let dtype = dtype_of(elem.elem_type as i64, &what)?;
    let mut items = vec![];
    while let Some(shape) = opts.input_shapes.get(&element_name(&vi.name, items.len())) {
        items.push(InputInfo {
            default: None,
            name: element_name(&vi.name, items.len()),
            dtype,
            shape: shape.iter().map(|&n| Dim::Fixed(n)).collect(),
            range: None,
            loc: None,
        });
    }
    if items.is_empty() {
        return Err(Error::Graph(format!(
            "{what} is a sequence; graphrun writes sequences out when it loads a model, and takes this one's elements as the inputs '{0}', '{1}', ...: give their shapes when loading (the command line takes them from --input '{0}=FILE.npy' ..., the library from ImportOptions::input_shapes)",
            element_name(&vi.name, 0),
            element_name(&vi.name, 1),
        )));
    }
    Ok(items)
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
