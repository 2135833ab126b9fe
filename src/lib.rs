//! graphrun: an ONNX-style graph executor. Load a YAML model (or an `.onnx` file),
//! validate it, infer its shapes, and run it on a backend; a `Session` optimizes the graph
//! first (constant folding, MatMul-epilogue and attention fusion: `passes::optimize`)
//! unless `SessionOptions::fuse` is off.
//!
//! ```no_run
//! use graphrun::{Model, Session, SessionOptions};
//! let model = Model::load("models/mlp.yaml").unwrap();
//! let feeds = model.random_inputs(0, &Default::default()).unwrap();
//! let mut session = Session::new(model.graph, SessionOptions::default()).unwrap();
//! for (name, t) in session.run(&feeds).unwrap() {
//!     println!("{name}: {:?}", t);
//! }
//! ```

#![deny(missing_docs)]

pub mod backends;
pub mod error;
pub mod exec;
pub mod files;
pub mod graph;
pub mod onnx;
pub mod passes;
pub mod rng;
pub mod tensor;
#[doc(hidden)]
pub mod testing;

pub use backends::tuning::{set_tuning, tuning, Tuning};
pub use backends::BackendKind;
pub use error::{Error, Result};
pub use exec::{DataParallel, Plan, Session, SessionOptions};
pub use graph::{Graph, Node, Op};
pub use tensor::{Bool, DType, Tensor};

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Checks a graph (`graph::validate::validate`) with the CPU reference evaluator for the
/// shape arithmetic inference computes on the host.
pub fn validate(g: &Graph) -> Result<()> {
    graph::validate::validate(g, &backends::cpu::HOST_EVAL)
}

/// Infers every value's type for these input shapes (`graph::infer::infer_graph`) with the
/// CPU reference evaluator.
pub fn infer_graph(
    g: &Graph,
    input_shapes: &HashMap<String, Vec<usize>>,
) -> Result<graph::infer::Inferred> {
    graph::infer::infer_graph(g, input_shapes, &backends::cpu::HOST_EVAL)
}

/// A loaded, validated model.
#[derive(Clone, Debug)]
pub struct Model {
    /// The model's graph (run it with `Session::new`).
    pub graph: Graph,
}

impl Model {
    /// Loads and validates a model file: YAML (SPEC §1), or ONNX when the file name ends
    /// in `.onnx`.
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        Self::load_with(path, &onnx::ImportOptions::default())
    }
    /// `load`, an ONNX file imported as `opts` says (`ImportMode::Train` to train it as
    /// PyTorch's train() mode runs it: BatchNormalization on batch statistics, its running
    /// statistics written back after each step; `ImportMode::Eval` to run it as eval()
    /// does). A YAML model is read as written: its `updates:` say what a training step
    /// writes back.
    pub fn load_with(path: impl AsRef<Path>, opts: &onnx::ImportOptions) -> Result<Model> {
        let path = path.as_ref();
        let graph = if onnx::is_onnx_path(path) {
            onnx::load_with(path, opts)?
        } else {
            graph::yaml::load(path, &backends::cpu::HOST_EVAL, &onnx::YamlLowering)?
        };
        Ok(Model { graph })
    }
    /// Loads a model from YAML text; relative initializer files resolve against `base`.
    pub fn from_str(text: &str, base: impl AsRef<Path>) -> Result<Model> {
        Ok(Model {
            graph: graph::yaml::load_str(
                text,
                "<string>",
                base.as_ref(),
                &backends::cpu::HOST_EVAL,
                &onnx::YamlLowering,
            )?,
        })
    }
    /// Writes the model back as YAML (self-contained; see `graph::yaml::save`).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        graph::yaml::save(&self.graph, path.as_ref()).map(|_| ())
    }
    /// `save`, returning the `.safetensors` file written beside the YAML for the large
    /// initializers and how many it holds (None when every initializer fit inline).
    pub fn save_with_side_file(
        &self,
        path: impl AsRef<Path>,
    ) -> Result<Option<(std::path::PathBuf, usize)>> {
        graph::yaml::save(&self.graph, path.as_ref())
    }
    /// Seeded random data for every graph input (its default where it has one); symbolic
    /// dims from `dims`, else the model's defaults.
    pub fn random_inputs(
        &self,
        seed: u64,
        dims: &BTreeMap<String, usize>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut all = self.graph.dims.clone();
        all.extend(dims.iter().map(|(k, v)| (k.clone(), *v)));
        self.graph
            .inputs
            .iter()
            .map(|i| {
                if let Some(d) = &i.default {
                    return Ok((i.name.clone(), d.clone()));
                }
                let shape = exec::concrete_shape(i, &all)?;
                Ok((i.name.clone(), exec::random_input(i, &shape, seed)?))
            })
            .collect()
    }
}
