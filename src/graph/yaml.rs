//! The model format (SPEC §1): YAML in, YAML out. The YAML is read into a small tree whose
//! every node keeps its line:col, so each error names the place at fault; the tree is
//! then decoded field by field with unknown fields rejected.

use super::lower::{self, ForeignNode, Lower};
use super::op::{Attr, AttrValue};
use super::*;
use crate::error::{Error, Loc, Result};
use crate::rng::Rng;
use crate::tensor::{checked_numel, fmt_shape, DType, Tensor};
use saphyr_parser::{Event, Parser, ScalarStyle};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

// ---- the marked YAML tree -----------------------------------------------------------

#[derive(Clone, Debug)]
pub(crate) enum YV {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Seq(Vec<Y>),
    Map(Vec<(String, Y)>),
}

#[derive(Clone, Debug)]
pub(crate) struct Y {
    pub v: YV,
    pub loc: Loc,
}

/// Parses YAML text into a marked tree. `file` is only used in locations.
pub(crate) fn parse_tree(text: &str, file: &str) -> Result<Y> {
    let loc = |m: &saphyr_parser::Marker| Loc {
        file: file.to_string(),
        line: m.line(),
        col: m.col() + 1,
    };
    let mut stack: Vec<(Y, Option<String>, Loc)> = vec![]; // container, pending map key, key loc
    let mut anchors: HashMap<usize, Y> = HashMap::new();
    let mut anchor_of: Vec<usize> = vec![];
    let mut root: Option<Y> = None;
    let mut docs = 0;
    // Hostile-input bounds: nesting depth (dropping a deep tree recurses) and the nodes
    // that aliases may copy (an alias "bomb" grows exponentially).
    const MAX_DEPTH: usize = 128;
    const MAX_ALIAS_NODES: usize = 1 << 20;
    let mut alias_nodes = 0usize;
    for ev in Parser::new_from_str(text) {
        let (ev, span) = ev
            .map_err(|e| Error::model(&loc(e.marker()), format!("malformed YAML: {}", e.info())))?;
        let here = loc(&span.start);
        let value = match ev {
            Event::DocumentStart(_) => {
                docs += 1;
                if docs > 1 {
                    return Err(Error::model(&here, "a model file holds one YAML document"));
                }
                continue;
            }
            Event::Scalar(s, style, anchor, _tag) => {
                let v = if style == ScalarStyle::Plain {
                    resolve_plain(&s)
                } else {
                    YV::Str(s.to_string())
                };
                let y = Y {
                    v,
                    loc: here.clone(),
                };
                if anchor > 0 {
                    anchors.insert(anchor, y.clone());
                }
                y
            }
            Event::Alias(id) => match anchors.get(&id) {
                Some(y) => {
                    alias_nodes += y.count();
                    if alias_nodes > MAX_ALIAS_NODES {
                        return Err(Error::model(&here, "YAML aliases expand to too many nodes"));
                    }
                    y.clone()
                }
                None => return Err(Error::model(&here, "YAML alias to an unknown anchor")),
            },
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                let v = if matches!(ev, Event::SequenceStart(..)) {
                    YV::Seq(vec![])
                } else {
                    YV::Map(vec![])
                };
                anchor_of.push(anchor);
                if stack.len() >= MAX_DEPTH {
                    return Err(Error::model(
                        &here,
                        format!("YAML is nested more than {MAX_DEPTH} levels deep"),
                    ));
                }
                stack.push((
                    Y {
                        v,
                        loc: here.clone(),
                    },
                    None,
                    here,
                ));
                continue;
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let (y, pending, _) = stack.pop().expect("balanced events");
                if let Some(k) = pending {
                    return Err(Error::model(
                        &y.loc,
                        format!("mapping key '{k}' has no value"),
                    ));
                }
                let anchor = anchor_of.pop().unwrap_or(0);
                if anchor > 0 {
                    anchors.insert(anchor, y.clone());
                }
                y
            }
            _ => continue,
        };
        // Attach the finished value to its parent (or make it the root).
        match stack.last_mut() {
            None => root = Some(value),
            Some((parent, pending, key_loc)) => match &mut parent.v {
                YV::Seq(items) => items.push(value),
                YV::Map(entries) => match pending.take() {
                    None => {
                        let key = match &value.v {
                            YV::Str(s) => s.clone(),
                            YV::Int(i) => i.to_string(),
                            YV::Bool(b) => b.to_string(),
                            YV::Float(f) => f.to_string(),
                            _ => {
                                return Err(Error::model(
                                    &value.loc,
                                    "mapping keys must be scalars",
                                ))
                            }
                        };
                        if entries.iter().any(|(k, _)| *k == key) {
                            return Err(Error::model(&value.loc, format!("duplicate key '{key}'")));
                        }
                        *key_loc = value.loc.clone();
                        *pending = Some(key);
                    }
                    Some(k) => entries.push((k, value)),
                },
                _ => unreachable!("only containers are on the stack"),
            },
        }
    }
    root.ok_or_else(|| {
        Error::model(
            &Loc {
                file: file.into(),
                line: 1,
                col: 1,
            },
            "the model file is empty",
        )
    })
}

/// YAML 1.2 core-schema resolution of a plain scalar.
fn resolve_plain(s: &str) -> YV {
    match s {
        "" | "~" | "null" | "Null" | "NULL" => return YV::Null,
        "true" | "True" | "TRUE" => return YV::Bool(true),
        "false" | "False" | "FALSE" => return YV::Bool(false),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => return YV::Float(f64::INFINITY),
        "-.inf" | "-.Inf" | "-.INF" => return YV::Float(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return YV::Float(f64::NAN),
        _ => {}
    }
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(i) = s.parse::<i64>() {
            return YV::Int(i);
        }
        // Integers beyond i64 are kept as floats so that "too large" is reported by range checks.
        if let Ok(f) = s.parse::<f64>() {
            return YV::Float(f);
        }
    }
    if let Some(h) = s.strip_prefix("0x") {
        if let Ok(i) = i64::from_str_radix(h, 16) {
            return YV::Int(i);
        }
    }
    let looks_float = s.bytes().any(|b| b.is_ascii_digit())
        && s.bytes()
            .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b));
    if looks_float {
        if let Ok(f) = s.parse::<f64>() {
            return YV::Float(f);
        }
    }
    YV::Str(s.to_string())
}

impl Y {
    /// Number of nodes in this subtree.
    fn count(&self) -> usize {
        1 + match &self.v {
            YV::Seq(s) => s.iter().map(Y::count).sum(),
            YV::Map(m) => m.iter().map(|(_, v)| v.count()).sum(),
            _ => 0,
        }
    }
    fn kind(&self) -> &'static str {
        match self.v {
            YV::Null => "null",
            YV::Bool(_) => "a boolean",
            YV::Int(_) => "an integer",
            YV::Float(_) => "a number",
            YV::Str(_) => "a string",
            YV::Seq(_) => "a list",
            YV::Map(_) => "a mapping",
        }
    }
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::model(&self.loc, msg)
    }
    fn want(&self, what: &str, want: &str) -> Error {
        self.err(format!("{what} must be {want}, got {}", self.kind()))
    }
    fn str(&self, what: &str) -> Result<&str> {
        match &self.v {
            YV::Str(s) => Ok(s),
            _ => Err(self.want(what, "a string")),
        }
    }
    fn int(&self, what: &str) -> Result<i64> {
        match self.v {
            YV::Int(i) => Ok(i),
            _ => Err(self.want(what, "an integer")),
        }
    }
    fn num(&self, what: &str) -> Result<f64> {
        match self.v {
            YV::Int(i) => Ok(i as f64),
            YV::Float(f) => Ok(f),
            _ => Err(self.want(what, "a number")),
        }
    }
    /// A finite number (NaN and infinities are refused, naming `what`).
    fn finite(&self, what: &str) -> Result<f64> {
        let v = self.num(what)?;
        if !v.is_finite() {
            return Err(self.err(format!("{what} must be a finite number, got {v}")));
        }
        Ok(v)
    }
    fn seq(&self, what: &str) -> Result<&[Y]> {
        match &self.v {
            YV::Seq(s) => Ok(s),
            _ => Err(self.want(what, "a list")),
        }
    }
    fn map<'a>(&'a self, what: &str, allowed: &[&'static str]) -> Result<Fields<'a>> {
        match &self.v {
            YV::Map(m) => {
                for (k, v) in m {
                    if !allowed.contains(&k.as_str()) {
                        return Err(Error::model(
                            &v.loc,
                            format!(
                                "unknown field '{k}' in {what}; expected one of: {}",
                                allowed.join(", ")
                            ),
                        ));
                    }
                }
                Ok(Fields {
                    m,
                    loc: &self.loc,
                    what: what.to_string(),
                })
            }
            _ => Err(self.want(what, "a mapping")),
        }
    }
}

/// The fields of one YAML mapping, already checked against the allowed names.
struct Fields<'a> {
    m: &'a [(String, Y)],
    loc: &'a Loc,
    what: String,
}

impl<'a> Fields<'a> {
    fn get(&self, k: &str) -> Option<&'a Y> {
        self.m
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v)
            .filter(|v| !matches!(v.v, YV::Null))
    }
    fn req(&self, k: &str) -> Result<&'a Y> {
        self.get(k).ok_or_else(|| {
            Error::model(
                self.loc,
                format!("{} is missing the field '{k}'", self.what),
            )
        })
    }
}

// ---- decoding a model ---------------------------------------------------------------

/// Loads and validates a model file; `ev` evaluates shape arithmetic while the shapes are
/// checked (see `validate::validate`).
pub fn load(path: &Path, ev: &dyn HostEval, lower: &dyn Lower) -> Result<Graph> {
    let text = crate::files::read_bytes(path, "the model")?;
    let text =
        String::from_utf8(text).map_err(|_| Error::io(path, "the model file is not UTF-8 text"))?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut g = parse_model(&text, &path.display().to_string(), &base, ev, lower)?;
    g.file = Some(path.to_path_buf());
    validate::validate(&g, ev)?;
    Ok(g)
}

/// Loads a model from text; `base` resolves relative initializer file paths.
pub fn load_str(
    text: &str,
    file: &str,
    base: &Path,
    ev: &dyn HostEval,
    lower: &dyn Lower,
) -> Result<Graph> {
    let g = parse_model(text, file, base, ev, lower)?;
    validate::validate(&g, ev)?;
    Ok(g)
}

/// `lower` writes the nodes whose ops are ONNX operators graphrun has no op for.
fn parse_model(
    text: &str,
    file: &str,
    base: &Path,
    ev: &dyn HostEval,
    lower: &dyn Lower,
) -> Result<Graph> {
    // Editors on Windows start UTF-8 files with a byte-order mark; YAML allows it.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let root = parse_tree(text, file)?;
    let top = root.map(
        "the model",
        &[
            "graphrun",
            "name",
            "dims",
            "inputs",
            "outputs",
            "initializers",
            "nodes",
            "training",
            "updates",
        ],
    )?;
    let version = top.req("graphrun")?;
    if !matches!(version.v, YV::Int(1)) {
        return Err(version.err(format!(
            "unsupported format version {}; this graphrun reads 'graphrun: 1'",
            scalar_text(version)
        )));
    }
    let name = match top.get("name") {
        Some(n) => n.str("name")?.to_string(),
        None => Path::new(file)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    let mut dims = BTreeMap::new();
    if let Some(d) = top.get("dims") {
        let YV::Map(m) = &d.v else {
            return Err(d.want("dims", "a mapping of symbol: size"));
        };
        for (k, v) in m {
            dims.insert(k.clone(), dim_size(v, &format!("dims.{k}"))?);
        }
    }
    let mut inputs = vec![];
    if let Some(list) = top.get("inputs") {
        for y in list.seq("inputs")? {
            inputs.push(parse_input(y, base)?);
        }
    }
    let mut outputs = vec![];
    for y in top.req("outputs")?.seq("outputs")? {
        outputs.push(y.str("an output name")?.to_string());
    }
    let mut initializers = vec![];
    if let Some(list) = top.get("initializers") {
        for y in list.seq("initializers")? {
            initializers.push(parse_initializer(y, base)?);
        }
    }
    let mut nodes = vec![];
    if let Some(list) = top.get("nodes") {
        for (i, y) in list.seq("nodes")?.iter().enumerate() {
            nodes.push(parse_node(y, i, lower)?);
        }
    }
    // Op errors are gathered so that every unsupported op is reported at once.
    let mut errs = vec![];
    let mut foreign = vec![];
    let nodes: Vec<Node> = nodes
        .into_iter()
        .filter_map(|n| match n {
            Ok(Parsed::Native(n)) => Some(n),
            Ok(Parsed::Foreign(f)) => {
                foreign.push(f);
                None
            }
            Err(e) => {
                errs.push(e);
                None
            }
        })
        .collect();
    if errs.len() == 1 {
        return Err(errs.pop().unwrap());
    } else if !errs.is_empty() {
        return Err(Error::Many(errs));
    }
    let training = top.get("training").map(parse_training).transpose()?;
    let mut updates = vec![];
    if let Some(u) = top.get("updates") {
        let YV::Map(m) = &u.v else {
            return Err(u.want("updates", "a mapping of initializer: value"));
        };
        for (target, v) in m {
            updates.push(super::StateUpdate {
                target: target.clone(),
                value: v.str(&format!("updates.{target}"))?.to_string(),
            });
        }
    }
    let mut g = Graph {
        name,
        dims,
        inputs,
        outputs,
        initializers,
        nodes,
        training,
        updates,
        file: None,
    };
    if !foreign.is_empty() {
        lower::lower_all(&mut g, &foreign, lower, ev)?;
    }
    super::infer::freeze_shape_deciding(&mut g);
    name_nodes(&mut g);
    Ok(g)
}

/// A node as read: one of graphrun's ops, or an ONNX operator the lowering writes.
enum Parsed {
    Native(Node),
    Foreign(ForeignNode),
}

fn scalar_text(y: &Y) -> String {
    match &y.v {
        YV::Int(i) => i.to_string(),
        YV::Float(f) => f.to_string(),
        YV::Str(s) => format!("'{s}'"),
        YV::Bool(b) => b.to_string(),
        _ => y.kind().to_string(),
    }
}

fn dim_size(y: &Y, what: &str) -> Result<usize> {
    match y.v {
        YV::Int(i) if i >= 0 => Ok(i as usize),
        YV::Int(i) => Err(y.err(format!("{what} must be a non-negative integer, got {i}"))),
        _ => Err(y.want(what, "a non-negative integer")),
    }
}

fn parse_dtype(y: &Y) -> Result<DType> {
    let s = y.str("dtype")?;
    DType::parse(s).ok_or_else(|| {
        y.err(format!(
            "unknown dtype '{s}'; expected one of f32, f16, bf16, f64, i64, i32, bool"
        ))
    })
}

fn parse_shape(y: &Y) -> Result<Vec<Dim>> {
    y.seq("shape")?
        .iter()
        .map(|d| match &d.v {
            YV::Str(s) if is_ident(s) => Ok(Dim::Sym(s.clone())),
            YV::Str(s) => Err(d.err(format!(
                "dimension '{s}' is not a valid symbol (letters, digits, _)"
            ))),
            _ => Ok(Dim::Fixed(dim_size(d, "a dimension")?)),
        })
        .collect()
}

fn is_ident(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(ch) if ch.is_alphabetic() || ch == '_')
        && c.all(|ch| ch.is_alphanumeric() || ch == '_')
}

/// A shape of numbers; `what` names its owner in errors.
fn fixed_shape(y: &Y, what: &str) -> Result<Vec<usize>> {
    let dims = parse_shape(y)?;
    let shape: Vec<usize> = dims
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => Ok(*n),
            Dim::Sym(s) => Err(y.err(format!(
                "{what}: the shape must be numbers, got symbol '{s}'"
            ))),
        })
        .collect::<Result<_>>()?;
    if checked_numel(&shape)
        .and_then(|n| n.checked_mul(8))
        .is_none()
    {
        return Err(y.err(format!(
            "{what}: shape {} is too large (its size overflows)",
            fmt_shape(&shape)
        )));
    }
    Ok(shape)
}

fn parse_input(y: &Y, base: &Path) -> Result<InputInfo> {
    let f = y.map("an input", &["name", "dtype", "shape", "range", "default"])?;
    let range = match f.get("range") {
        None => None,
        Some(r) => {
            let v = r.seq("range")?;
            if v.len() != 2 {
                return Err(r.err(format!("range must be [low, high], got {} values", v.len())));
            }
            let (lo, hi) = (v[0].finite("range low")?, v[1].finite("range high")?);
            // Written so that NaN bounds fail too.
            if lo.partial_cmp(&hi) != Some(std::cmp::Ordering::Less) {
                return Err(r.err(format!(
                    "range [{lo}, {hi}] is empty: low must be below high"
                )));
            }
            Some((lo, hi))
        }
    };
    let name = f.req("name")?.str("name")?.to_string();
    let dtype = parse_dtype(f.req("dtype")?)?;
    let shape = parse_shape(f.req("shape")?)?;
    let default = f
        .get("default")
        .map(|d| parse_default(d, base, &name, dtype, &shape))
        .transpose()?;
    Ok(InputInfo {
        name,
        dtype,
        shape,
        range,
        default,
        loc: Some(y.loc.clone()),
    })
}

/// An input's `default:` — `{values: [...]}` or `{file: F, key: K}` — checked against the
/// input's dtype and shape (a symbolic dim takes any size).
fn parse_default(y: &Y, base: &Path, name: &str, dtype: DType, shape: &[Dim]) -> Result<Tensor> {
    let f = y.map(
        &format!("the default of input '{name}'"),
        &["values", "file", "key"],
    )?;
    let t = if let Some(v) = f.get("values") {
        let fixed: Option<Vec<usize>> = shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => Some(*n),
                Dim::Sym(_) => None,
            })
            .collect();
        let Some(fixed) = fixed else {
            return Err(v.err(format!(
                "input '{name}': a default given by values needs a shape of numbers; use file: for a symbolic one"
            )));
        };
        let vals = parse_values(v, dtype)?;
        Tensor::from_f64(dtype, &fixed, &vals).map_err(|e| v.err(format!("input '{name}': {e}")))?
    } else {
        let file = f.req("file")?;
        let rel = PathBuf::from(file.str("file")?);
        let path = crate::files::resolve_inside(base, &rel)
            .map_err(|e| file.err(format!("input '{name}': {e}")))?;
        let key = f.get("key").map(|k| k.str("key")).transpose()?;
        read_tensor_file(&path, key, name).map_err(|e| file.err(e.to_string()))?
    };
    let fits = t.dtype() == dtype
        && t.shape().len() == shape.len()
        && shape
            .iter()
            .zip(t.shape())
            .all(|(d, &n)| matches!(d, Dim::Sym(_)) || *d == Dim::Fixed(n));
    if !fits {
        return Err(y.err(format!(
            "input '{name}': the default is {} {}, which does not fit the input",
            t.dtype(),
            fmt_shape(t.shape())
        )));
    }
    Ok(t)
}

fn parse_initializer(y: &Y, base: &Path) -> Result<Initializer> {
    let f = y.map(
        "an initializer",
        &[
            "name",
            "dtype",
            "shape",
            "init",
            "values",
            "file",
            "key",
            "trainable",
        ],
    )?;
    let name = f.req("name")?.str("name")?.to_string();
    let given = ["init", "values", "file"]
        .iter()
        .filter(|k| f.get(k).is_some())
        .count();
    if given != 1 {
        return Err(y.err(format!(
            "initializer '{name}' must have exactly one of init, values, file (has {given})"
        )));
    }
    let dtype = f.get("dtype").map(parse_dtype).transpose()?;
    let shape = f
        .get("shape")
        .map(|y| fixed_shape(y, &format!("initializer '{name}'")))
        .transpose()?;
    if f.get("key").is_some() && f.get("file").is_none() {
        return Err(f.req("key")?.err("'key' only goes with 'file'"));
    }
    let (tensor, source) = if let Some(file) = f.get("file") {
        let rel = PathBuf::from(file.str("file")?);
        if !matches!(
            rel.extension().and_then(|e| e.to_str()),
            Some("npy" | "safetensors")
        ) {
            return Err(file.err(format!(
                "initializer '{name}': {}: initializer files must be .npy or .safetensors",
                rel.display()
            )));
        }
        let path = crate::files::resolve_inside(base, &rel)
            .map_err(|e| file.err(format!("initializer '{name}': {e}")))?;
        let key = f
            .get("key")
            .map(|k| k.str("key").map(str::to_string))
            .transpose()?;
        let t =
            read_tensor_file(&path, key.as_deref(), &name).map_err(|e| file.err(e.to_string()))?;
        if let Some(d) = dtype {
            if d != t.dtype() {
                return Err(file.err(format!(
                    "initializer '{name}': {} holds {}, but the model says dtype {d}",
                    path.display(),
                    t.dtype()
                )));
            }
        }
        if let Some(s) = &shape {
            if s.as_slice() != t.shape() {
                return Err(file.err(format!(
                    "initializer '{name}': {} holds shape {}, but the model says shape {}",
                    path.display(),
                    fmt_shape(t.shape()),
                    fmt_shape(s)
                )));
            }
        }
        (t, InitSource::File { path, key })
    } else {
        let Some(dtype) = dtype else {
            return Err(y.err(format!("initializer '{name}' is missing the field 'dtype'")));
        };
        let Some(shape) = shape else {
            return Err(y.err(format!("initializer '{name}' is missing the field 'shape'")));
        };
        if let Some(v) = f.get("values") {
            let vals = parse_values(v, dtype)?;
            if vals.len() != crate::tensor::numel(&shape) {
                return Err(v.err(format!(
                    "initializer '{name}' has shape {} ({} values) but {} values are given",
                    fmt_shape(&shape),
                    crate::tensor::numel(&shape),
                    vals.len()
                )));
            }
            (Tensor::from_f64(dtype, &shape, &vals)?, InitSource::Data)
        } else {
            let iy = f.req("init")?;
            let spec = parse_init_spec(iy)?;
            if matches!(spec, InitSpec::Dist { .. }) && !dtype.is_float() {
                return Err(iy.err(format!(
                    "initializer '{name}': random init needs a floating dtype, not {dtype}"
                )));
            }
            let t = generate(&spec, dtype, &shape).map_err(|e| {
                iy.err(format!(
                    "initializer '{name}' of shape {}: {e}",
                    fmt_shape(&shape)
                ))
            })?;
            (t, InitSource::Init(spec))
        }
    };
    let trainable = match f.get("trainable") {
        None => tensor.dtype().is_float(),
        Some(t) => match t.v {
            YV::Bool(b) => {
                if b && !tensor.dtype().is_float() {
                    return Err(t.err(format!(
                        "initializer '{name}' of dtype {} cannot be trainable",
                        tensor.dtype()
                    )));
                }
                b
            }
            _ => return Err(t.want("trainable", "true or false")),
        },
    };
    Ok(Initializer {
        name,
        tensor,
        trainable,
        source,
        loc: Some(y.loc.clone()),
    })
}

fn read_tensor_file(path: &Path, key: Option<&str>, name: &str) -> Result<Tensor> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "npy" => {
            if key.is_some() {
                crate::bail!(Input, "'key' is only for .safetensors files");
            }
            Tensor::read_npy_as(path, &format!("initializer '{name}'"))
        }
        "safetensors" => Tensor::read_safetensors_key(
            path,
            key.unwrap_or(name),
            &format!("initializer '{name}'"),
        ),
        _ => Err(Error::io(
            path,
            "initializer files must be .npy or .safetensors",
        )),
    }
}

fn parse_values(y: &Y, dtype: DType) -> Result<Vec<f64>> {
    let items: Vec<&Y> = match &y.v {
        YV::Seq(s) => s.iter().collect(),
        _ => vec![y], // a scalar is a one-element list
    };
    items
        .into_iter()
        .map(|v| {
            let in_range = |x: f64, shown: String| match dtype.int_range() {
                Some((lo, hi)) if !(x >= lo as f64 && x <= hi as f64) => {
                    Err(v.err(format!("{shown} is out of the {dtype} range [{lo}, {hi}]")))
                }
                _ => Ok(x),
            };
            match (&v.v, dtype) {
                (YV::Bool(b), DType::Bool) => Ok(*b as u8 as f64),
                (YV::Int(i), _) => in_range(*i as f64, i.to_string()),
                (YV::Float(x), d) if d.is_float() => Ok(*x),
                (YV::Float(x), d) if d.is_int() && x.fract() == 0.0 => {
                    in_range(*x, format!("{x:e}"))
                }
                (YV::Float(x), d) if d.is_int() && x.is_finite() => Err(v.err(format!(
                    "a value of dtype {dtype} must be an integer, got {x}"
                ))),
                (YV::Float(x), d) if d.is_int() => in_range(*x, format!("{x:e}")),
                _ => Err(v.err(format!("a value of dtype {dtype} cannot be {}", v.kind()))),
            }
        })
        .collect()
}

fn parse_init_spec(y: &Y) -> Result<InitSpec> {
    if let YV::Str(s) = &y.v {
        return match s.as_str() {
            "zeros" => Ok(InitSpec::Zeros),
            "ones" => Ok(InitSpec::Ones),
            _ => Err(y.err(format!("unknown init '{s}'; expected zeros, ones, {{constant: V}} or {{dist: ..., seed: N}}"))),
        };
    }
    let f = y.map(
        "init",
        &["constant", "dist", "seed", "mean", "std", "low", "high"],
    )?;
    if let Some(c) = f.get("constant") {
        if f.m.len() > 1 {
            return Err(y.err("init {constant: V} takes no other fields"));
        }
        return Ok(InitSpec::Constant(c.num("constant")?));
    }
    let d = f.req("dist")?;
    let seed_y = f.req("seed")?;
    let seed = seed_y.int("seed")?;
    if seed < 0 {
        return Err(seed_y.err("seed must be non-negative"));
    }
    let allowed: &[&str] = match d.str("dist")? {
        "normal" => &["mean", "std"],
        "uniform" => &["low", "high"],
        _ => &[],
    };
    for (k, v) in f.m {
        if !["dist", "seed"].contains(&k.as_str()) && !allowed.contains(&k.as_str()) {
            return Err(v.err(format!(
                "field '{k}' does not apply to dist '{}'",
                d.str("dist")?
            )));
        }
    }
    let num = |k: &str, default: f64| -> Result<f64> {
        f.get(k)
            .map(|v| v.finite(k))
            .transpose()
            .map(|v| v.unwrap_or(default))
    };
    let dist = match d.str("dist")? {
        "normal" => {
            let std = num("std", 1.0)?;
            if std < 0.0 {
                return Err(f.req("std")?.err("std must be non-negative"));
            }
            Dist::Normal { mean: num("mean", 0.0)?, std }
        }
        "uniform" => {
            let (low, high) = (num("low", 0.0)?, num("high", 1.0)?);
            if low > high {
                return Err(y.err(format!("uniform low {low} is above high {high}")));
            }
            Dist::Uniform { low, high }
        }
        "xavier_uniform" => Dist::XavierUniform,
        "xavier_normal" => Dist::XavierNormal,
        "kaiming_uniform" => Dist::KaimingUniform,
        "kaiming_normal" => Dist::KaimingNormal,
        s => {
            return Err(d.err(format!(
                "unknown dist '{s}'; expected normal, uniform, xavier_uniform, xavier_normal, kaiming_uniform, kaiming_normal"
            )))
        }
    };
    Ok(InitSpec::Dist {
        dist,
        seed: seed as u64,
    })
}

/// Fan-in and fan-out of a weight in MatMul layout `[..., in, out]`.
fn fans(shape: &[usize]) -> (f64, f64) {
    match shape.len() {
        0 => (1.0, 1.0),
        1 => (shape[0] as f64, shape[0] as f64),
        n => {
            let rf: usize = shape[..n - 2].iter().product();
            ((shape[n - 2] * rf) as f64, (shape[n - 1] * rf) as f64)
        }
    }
}

/// Materialises an `init:` spec. Values are drawn in f64 from graphrun's own generator and
/// rounded to the dtype, so the same seed gives the same bits everywhere. The tensor is
/// allocated first (within the byte limit, see `tensor::set_max_bytes`), so an absurd
/// shape is an error, not an abort.
pub fn generate(spec: &InitSpec, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let mut t = Tensor::try_zeros(dtype, shape, "the initializer")?;
    let mut r = Rng::new(match spec {
        InitSpec::Dist { seed, .. } => *seed,
        _ => 0,
    });
    let (fi, fo) = fans(shape);
    let (fi, fo) = (fi.max(1.0), fo.max(1.0));
    let mut draw: Box<dyn FnMut() -> f64> = match spec {
        InitSpec::Zeros => Box::new(|| 0.0),
        InitSpec::Ones => Box::new(|| 1.0),
        InitSpec::Constant(c) => {
            let c = *c;
            Box::new(move || c)
        }
        InitSpec::Dist { dist, .. } => match *dist {
            Dist::Normal { mean, std } => Box::new(move || mean + std * r.normal()),
            Dist::Uniform { low, high } => Box::new(move || r.uniform_in(low, high)),
            Dist::XavierUniform => {
                let b = (6.0 / (fi + fo)).sqrt();
                Box::new(move || r.uniform_in(-b, b))
            }
            Dist::XavierNormal => {
                let s = (2.0 / (fi + fo)).sqrt();
                Box::new(move || s * r.normal())
            }
            // Kaiming with the ReLU gain sqrt(2), as PyTorch's defaults for ReLU nets.
            Dist::KaimingUniform => {
                let b = (6.0 / fi).sqrt();
                Box::new(move || r.uniform_in(-b, b))
            }
            Dist::KaimingNormal => {
                let s = (2.0 / fi).sqrt();
                Box::new(move || s * r.normal())
            }
        },
    };
    crate::with_any!(dtype, T => {
        for v in t.as_mut_slice::<T>() {
            *v = <T as crate::tensor::Elem>::from_f64(draw());
        }
    });
    Ok(t)
}

fn parse_node(y: &Y, index: usize, lower: &dyn Lower) -> Result<Result<Parsed>> {
    let f = y.map("a node", &["op", "inputs", "outputs", "attrs", "name"])?;
    let op_name = f.req("op")?.str("op")?;
    let names = |k: &str| -> Result<Vec<String>> {
        match f.get(k) {
            None => Ok(vec![]),
            Some(v) => v
                .seq(k)?
                .iter()
                .map(|s| match &s.v {
                    YV::Null => Ok(String::new()), // an omitted optional input
                    _ => s.str("a value name").map(str::to_string),
                })
                .collect(),
        }
    };
    let inputs = names("inputs")?;
    let outputs = names("outputs")?;
    if outputs.is_empty() {
        return Err(y.err(format!("node {index} ({op_name}) has no outputs")));
    }
    let name = match f.get("name") {
        Some(n) => n.str("name")?.to_string(),
        None => String::new(),
    };
    let mut attrs = vec![];
    if let Some(a) = f.get("attrs") {
        let YV::Map(m) = &a.v else {
            return Err(a.want("attrs", "a mapping"));
        };
        for (k, v) in m {
            attrs.push(Attr {
                name: k.clone(),
                value: parse_attr(v, k)?,
                loc: Some(v.loc.clone()),
            });
        }
    }
    let shown = if name.is_empty() {
        format!("#{index}")
    } else {
        name.clone()
    };
    if lower.lowers(op_name, inputs.len()) {
        return Ok(Ok(Parsed::Foreign(ForeignNode {
            index,
            name,
            op: op_name.to_string(),
            attrs,
            inputs,
            outputs,
            loc: Some(y.loc.clone()),
        })));
    }
    let op = match Op::parse(op_name, &attrs, &shown, Some(&y.loc)) {
        Ok(op) => op,
        Err(e) => return Ok(Err(e)),
    };
    Ok(Ok(Parsed::Native(Node {
        name,
        op,
        inputs,
        outputs,
        loc: Some(y.loc.clone()),
    })))
}

fn parse_attr(y: &Y, name: &str) -> Result<AttrValue> {
    Ok(match &y.v {
        YV::Int(i) => AttrValue::Int(*i),
        YV::Bool(b) => AttrValue::Int(*b as i64),
        YV::Float(f) => AttrValue::Float(*f),
        YV::Str(s) => AttrValue::Str(s.clone()),
        YV::Seq(items) => {
            if items.iter().all(|i| matches!(i.v, YV::Int(_))) && !items.is_empty() {
                AttrValue::Ints(items.iter().map(|i| i.int("")).collect::<Result<_>>()?)
            } else if items
                .iter()
                .all(|i| matches!(i.v, YV::Int(_) | YV::Float(_)))
            {
                AttrValue::Floats(items.iter().map(|i| i.num("")).collect::<Result<_>>()?)
            } else if items.iter().all(|i| matches!(i.v, YV::Str(_))) {
                AttrValue::Strs(
                    items
                        .iter()
                        .map(|i| i.str("").map(str::to_string))
                        .collect::<Result<_>>()?,
                )
            } else {
                return Err(y.err(format!("attribute '{name}' mixes value types in one list")));
            }
        }
        YV::Map(_) => {
            let f = y.map(
                &format!("tensor attribute '{name}'"),
                &["dtype", "shape", "values"],
            )?;
            let dtype = parse_dtype(f.req("dtype")?)?;
            let shape = fixed_shape(f.req("shape")?, &format!("tensor attribute '{name}'"))?;
            let vy = f.req("values")?;
            let vals = parse_values(vy, dtype)?;
            if vals.len() != crate::tensor::numel(&shape) {
                return Err(vy.err(format!(
                    "tensor attribute '{name}' has shape {} but {} values",
                    fmt_shape(&shape),
                    vals.len()
                )));
            }
            AttrValue::Tensor(Tensor::from_f64(dtype, &shape, &vals)?)
        }
        YV::Null => return Err(y.err(format!("attribute '{name}' has no value"))),
    })
}

fn parse_training(y: &Y) -> Result<Training> {
    let f = y.map("training", &["loss", "optimizer"])?;
    let loss = f.req("loss")?.str("loss")?.to_string();
    let oy = f.req("optimizer")?;
    let YV::Map(m) = &oy.v else {
        return Err(oy.want("optimizer", "a mapping like {adam: {lr: 0.001}}"));
    };
    if m.len() != 1 {
        return Err(oy.err("optimizer must name exactly one of sgd, adam, adamw"));
    }
    let (kind, cfg) = &m[0];
    let allowed: &[&'static str] = match kind.as_str() {
        "sgd" => &["lr", "momentum", "weight_decay"],
        "adam" | "adamw" => &["lr", "beta1", "beta2", "eps", "weight_decay"],
        _ => {
            return Err(cfg.err(format!(
                "unknown optimizer '{kind}'; expected sgd, adam or adamw"
            )))
        }
    };
    let empty = Y {
        v: YV::Map(vec![]),
        loc: cfg.loc.clone(),
    };
    let cfg = if matches!(cfg.v, YV::Null) {
        &empty
    } else {
        cfg
    };
    let c = cfg.map(&format!("optimizer {kind}"), allowed)?;
    let num = |k: &str, d: f64| -> Result<f64> {
        c.get(k)
            .map(|v| v.num(k))
            .transpose()
            .map(|v| v.unwrap_or(d))
    };
    let optimizer = match kind.as_str() {
        "sgd" => Optimizer::Sgd {
            lr: num("lr", 0.01)?,
            momentum: num("momentum", 0.0)?,
            weight_decay: num("weight_decay", 0.0)?,
        },
        "adam" => Optimizer::Adam {
            lr: num("lr", 0.001)?,
            beta1: num("beta1", 0.9)?,
            beta2: num("beta2", 0.999)?,
            eps: num("eps", 1e-8)?,
            weight_decay: num("weight_decay", 0.0)?,
        },
        _ => Optimizer::AdamW {
            lr: num("lr", 0.001)?,
            beta1: num("beta1", 0.9)?,
            beta2: num("beta2", 0.999)?,
            eps: num("eps", 1e-8)?,
            weight_decay: num("weight_decay", 0.01)?,
        },
    };
    if let Err((field, msg)) = optimizer.check() {
        let at = c.get(field).unwrap_or(cfg);
        return Err(at.err(format!("optimizer {kind}: {msg}")));
    }
    Ok(Training { loss, optimizer })
}

/// Gives every unnamed node a stable name: `<op>_<index>`, unique in the graph.
pub fn name_nodes(g: &mut Graph) {
    let mut taken: std::collections::HashSet<String> =
        g.nodes.iter().map(|n| n.name.clone()).collect();
    for i in 0..g.nodes.len() {
        if g.nodes[i].name.is_empty() {
            let base = format!("{}_{}", g.nodes[i].op.name(), i);
            let mut name = base.clone();
            let mut k = 1;
            while taken.contains(&name) {
                name = format!("{base}_{k}");
                k += 1;
            }
            taken.insert(name.clone());
            g.nodes[i].name = name;
        }
    }
}

// ---- writing a model back -----------------------------------------------------------

/// Whether `save` writes `init` into the side file (rather than as a spec or values).
fn in_side_file(init: &Initializer) -> bool {
    !matches!(init.source, InitSource::Init(_)) && init.tensor.numel() > 64
}

/// The files `save(g, path)` writes: `path`, and the side file when `g` needs one.
pub fn save_paths(g: &Graph, path: &Path) -> Vec<PathBuf> {
    let mut v = vec![path.to_path_buf()];
    let big_default = g
        .inputs
        .iter()
        .any(|i| i.default.as_ref().is_some_and(|t| t.numel() > 64));
    if g.initializers.iter().any(in_side_file) || big_default {
        v.push(side_file(path));
    }
    v
}

/// The file `save` puts large initializers in: `<stem>.safetensors` beside `path`.
pub fn side_file(path: &Path) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    path.with_file_name(format!("{stem}.safetensors"))
}

/// Writes `g` to `path` as a self-contained model: initializers given by `init:` are
/// written as the same spec (regenerated bit-exactly), small ones inline, the rest into
/// `side_file(path)`. Both files are written whole or neither is. Returns that side file
/// and how many initializers went into it, when there is one.
pub fn save(g: &Graph, path: &Path) -> Result<Option<(PathBuf, usize)>> {
    let mut out = crate::files::Outputs::new();
    let side = stage(g, path, &mut out)?;
    out.commit()?;
    Ok(side)
}

/// `save`'s files, staged in `out` (written when `out` is committed); returns the side
/// file and its initializer count, when there is one.
pub fn stage(
    g: &Graph,
    path: &Path,
    out: &mut crate::files::Outputs,
) -> Result<Option<(PathBuf, usize)>> {
    let side_path = side_file(path);
    let side_name = side_path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (text, side) = emit(g, &side_name);
    let mut written = None;
    if !side.is_empty() {
        let refs: Vec<(String, &Tensor)> = side.iter().map(|(n, t)| (n.clone(), *t)).collect();
        out.stage(&side_path, |w| Tensor::write_safetensors_to(&refs, w))?;
        written = Some((side_path, side.len()));
    }
    out.stage(path, |w| w.write_all(text.as_bytes()))?;
    Ok(written)
}

/// The YAML text of `g`, and the tensors that go into the side file `side_name`.
pub fn emit<'g>(g: &'g Graph, side_name: &str) -> (String, Vec<(String, &'g Tensor)>) {
    let mut o = String::new();
    let mut side = vec![];
    o.push_str("graphrun: 1\n");
    o.push_str(&format!("name: {}\n", ystr(&g.name)));
    if !g.dims.is_empty() {
        let d: Vec<String> = g
            .dims
            .iter()
            .map(|(k, v)| format!("{}: {v}", ystr(k)))
            .collect();
        o.push_str(&format!("dims: {{{}}}\n", d.join(", ")));
    }
    o.push_str("inputs:\n");
    for i in &g.inputs {
        let shape: Vec<String> = i
            .shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => n.to_string(),
                Dim::Sym(s) => ystr(s),
            })
            .collect();
        let range = i
            .range
            .map(|(l, h)| format!(", range: [{}, {}]", yf(l), yf(h)))
            .unwrap_or_default();
        let default = match &i.default {
            None => String::new(),
            Some(t) if t.numel() <= 64 => format!(", default: {{values: {}}}", emit_values(t)),
            Some(t) => {
                side.push((i.name.clone(), t));
                format!(
                    ", default: {{file: {}, key: {}}}",
                    ystr(side_name),
                    ystr(&i.name)
                )
            }
        };
        o.push_str(&format!(
            "  - {{name: {}, dtype: {}, shape: [{}]{range}{default}}}\n",
            ystr(&i.name),
            i.dtype,
            shape.join(", ")
        ));
    }
    o.push_str(&format!(
        "outputs: [{}]\n",
        g.outputs
            .iter()
            .map(|s| ystr(s))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    o.push_str("initializers:\n");
    for init in &g.initializers {
        let t = &init.tensor;
        let mut line = format!("  - {{name: {}", ystr(&init.name));
        let head = format!(", dtype: {}, shape: {}", t.dtype(), fmt_shape(t.shape()));
        match &init.source {
            InitSource::Init(spec) => {
                line.push_str(&head);
                line.push_str(&format!(", init: {}", emit_spec(spec)));
            }
            _ if !in_side_file(init) => {
                line.push_str(&head);
                line.push_str(&format!(", values: {}", emit_values(t)));
            }
            _ => {
                line.push_str(&format!(
                    ", file: {}, key: {}",
                    ystr(side_name),
                    ystr(&init.name)
                ));
                side.push((init.name.clone(), t));
            }
        }
        if init.trainable != t.dtype().is_float() {
            line.push_str(&format!(", trainable: {}", init.trainable));
        }
        line.push_str("}\n");
        o.push_str(&line);
    }
    o.push_str("nodes:\n");
    for n in &g.nodes {
        let ins: Vec<String> = n
            .inputs
            .iter()
            .map(|s| if s.is_empty() { "null".into() } else { ystr(s) })
            .collect();
        let outs: Vec<String> = n.outputs.iter().map(|s| ystr(s)).collect();
        let mut line = format!(
            "  - {{op: {}, name: {}, inputs: [{}], outputs: [{}]",
            n.op.name(),
            ystr(&n.name),
            ins.join(", "),
            outs.join(", ")
        );
        let attrs = n.op.attrs();
        if !attrs.is_empty() {
            let a: Vec<String> = attrs
                .iter()
                .map(|(k, v)| format!("{k}: {}", emit_attr(v)))
                .collect();
            line.push_str(&format!(", attrs: {{{}}}", a.join(", ")));
        }
        line.push_str("}\n");
        o.push_str(&line);
    }
    if let Some(t) = &g.training {
        let opt = match &t.optimizer {
            Optimizer::Sgd {
                lr,
                momentum,
                weight_decay,
            } => format!(
                "{{sgd: {{lr: {}, momentum: {}, weight_decay: {}}}}}",
                yf(*lr),
                yf(*momentum),
                yf(*weight_decay)
            ),
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            }
            | Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => format!(
                "{{{}: {{lr: {}, beta1: {}, beta2: {}, eps: {}, weight_decay: {}}}}}",
                if matches!(t.optimizer, Optimizer::AdamW { .. }) {
                    "adamw"
                } else {
                    "adam"
                },
                yf(*lr),
                yf(*beta1),
                yf(*beta2),
                yf(*eps),
                yf(*weight_decay)
            ),
        };
        o.push_str(&format!(
            "training:\n  loss: {}\n  optimizer: {opt}\n",
            ystr(&t.loss)
        ));
    }
    if !g.updates.is_empty() {
        o.push_str("updates:\n");
        for u in &g.updates {
            o.push_str(&format!("  {}: {}\n", ystr(&u.target), ystr(&u.value)));
        }
    }
    (o, side)
}

fn emit_spec(s: &InitSpec) -> String {
    match s {
        InitSpec::Zeros => "zeros".into(),
        InitSpec::Ones => "ones".into(),
        InitSpec::Constant(c) => format!("{{constant: {}}}", yf(*c)),
        InitSpec::Dist { dist, seed } => {
            let d = match dist {
                Dist::Normal { mean, std } => {
                    format!("normal, mean: {}, std: {}", yf(*mean), yf(*std))
                }
                Dist::Uniform { low, high } => {
                    format!("uniform, low: {}, high: {}", yf(*low), yf(*high))
                }
                Dist::XavierUniform => "xavier_uniform".into(),
                Dist::XavierNormal => "xavier_normal".into(),
                Dist::KaimingUniform => "kaiming_uniform".into(),
                Dist::KaimingNormal => "kaiming_normal".into(),
            };
            format!("{{dist: {d}, seed: {seed}}}")
        }
    }
}

fn emit_values(t: &Tensor) -> String {
    let v = t.to_f64_vec();
    let items: Vec<String> = v
        .iter()
        .map(|&x| match t.dtype() {
            DType::Bool => (x != 0.0).to_string(),
            d if d.is_int() => (x as i64).to_string(),
            // f64 written shortest round-trip: f32/f16/bf16 values are exact in f64.
            _ => yf(x),
        })
        .collect();
    format!("[{}]", items.join(", "))
}

fn emit_attr(v: &AttrValue) -> String {
    match v {
        AttrValue::Int(i) => i.to_string(),
        AttrValue::Float(f) => yf(*f),
        AttrValue::Str(s) => ystr(s),
        AttrValue::Ints(v) => format!(
            "[{}]",
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        AttrValue::Floats(v) => format!(
            "[{}]",
            v.iter().map(|x| yf(*x)).collect::<Vec<_>>().join(", ")
        ),
        AttrValue::Strs(v) => format!(
            "[{}]",
            v.iter().map(|x| ystr(x)).collect::<Vec<_>>().join(", ")
        ),
        AttrValue::Tensor(t) => format!(
            "{{dtype: {}, shape: {}, values: {}}}",
            t.dtype(),
            fmt_shape(t.shape()),
            emit_values(t)
        ),
    }
}

/// A float as YAML reads it back exactly (always with a '.', 'e', or a special).
fn yf(x: f64) -> String {
    if x.is_nan() {
        ".nan".into()
    } else if x.is_infinite() {
        if x > 0.0 {
            ".inf".into()
        } else {
            "-.inf".into()
        }
    } else {
        let s = format!("{x:?}");
        if s.contains(['.', 'e', 'E']) {
            s
        } else {
            format!("{s}.0")
        }
    }
}

/// A string, quoted when plain YAML would read it as something else.
fn ystr(s: &str) -> String {
    let plain_ok = !s.is_empty()
        && s.chars().all(|c| c.is_alphanumeric() || "_-./".contains(c))
        && !s.starts_with(['-', '.'])
        && matches!(resolve_plain(s), YV::Str(_));
    if plain_ok {
        s.to_string()
    } else {
        let mut q = String::from("\"");
        for c in s.chars() {
            match c {
                '"' => q.push_str("\\\""),
                '\\' => q.push_str("\\\\"),
                '\n' => q.push_str("\\n"),
                c if (c as u32) < 0x20 => q.push_str(&format!("\\x{:02x}", c as u32)),
                c => q.push(c),
            }
        }
        q.push('"');
        q
    }
}
