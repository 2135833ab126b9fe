//! The `graphrun` command line (SPEC §5): argument parsing and printing on top of the
//! library. Exit codes: 0 success, 2 bad model or arguments, 1 failure while running.

use clap::{Args, Parser, Subcommand};
use graphrun::error::Error;
use graphrun::exec;
use graphrun::files::{self, write_atomic};
use graphrun::passes;
use graphrun::{BackendKind, DType, Model, Session, SessionOptions, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "graphrun",
    version,
    about = "Run, inspect and train ONNX-style YAML models (or .onnx files) on CPU, CUDA or WebGPU",
    after_help = "`graphrun MODEL [options]` is short for `graphrun run MODEL [options]`; MODEL is a .yaml model or an .onnx file."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Refuse to allocate more than this much host memory for one tensor or one plan
    /// (e.g. 8G, 512M; default: the machine's physical memory).
    #[arg(long, global = true, value_name = "BYTES", value_parser = graphrun::tensor::parse_size)]
    max_memory: Option<usize>,
    /// Let a model name data files outside its own folder (external data, `file:`
    /// initializers: absolute paths, `..`, symlinks that lead elsewhere). Off by default,
    /// so a model cannot make graphrun read files the user did not give it.
    #[arg(long, global = true)]
    allow_outside_files: bool,
    /// Developer switch for kernel A/B runs: KEY=VALUE sets a field of graphrun::Tuning
    /// (repeatable; dev/README.md lists the keys). Hidden: the defaults are the measured
    /// best, and users never need it.
    #[arg(long = "tune", global = true, hide = true, value_name = "KEY=VALUE")]
    tune: Vec<String>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a model and print (or save) its outputs.
    Run(RunArgs),
    /// Summarize a model: inputs and outputs, op counts before and after the passes, FLOPs
    /// and planned memory; --nodes lists it node by node, --dot and --emit-yaml write it.
    Inspect(InspectArgs),
    /// Report what this machine offers: CPU threads, CUDA, WebGPU adapters.
    Doctor,
    /// Time a model: median/min/max per iteration, throughput, memory, per-node profile.
    Bench(BenchArgs),
    /// Train a model's trainable initializers on data.
    Train(TrainArgs),
    /// Write a model (e.g. an .onnx file) as a YAML model, initializers beside it.
    Convert(ConvertArgs),
}

#[derive(Args, Clone)]
struct Common {
    /// Backend to run on.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    backend: String,
    /// Bind a symbolic dim: SYM=N.
    #[arg(long = "dim", value_name = "SYM=N")]
    dims: Vec<String>,
    /// Cast floating inputs and initializers to this dtype before running. tf32 is f32
    /// storage with TF32 tensor-core matrix products (PyTorch's allow_tf32) on CUDA, and
    /// plain f32 on the CPU.
    #[arg(long, value_parser = ["f32", "tf32", "f16", "bf16"])]
    dtype: Option<String>,
    /// Run the graph as written, without the fusion passes.
    #[arg(long)]
    no_fuse: bool,
    /// Switch one pass off by name (repeatable; see `graphrun inspect`).
    #[arg(long = "disable-pass", value_name = "PASS")]
    disable_pass: Vec<String>,
}

#[derive(Args)]
struct RunArgs {
    /// The model: a .yaml model file or an .onnx file.
    model: PathBuf,
    #[command(flatten)]
    common: Common,
    /// Feed an input from a .npy file: NAME=FILE.npy.
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
    /// Fill inputs not given with --input with seeded random data.
    #[arg(long)]
    random_inputs: bool,
    /// Seed for random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write DIR/<output>.npy for every output.
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
    /// Also run the backward graph and print (with --out-dir write) the gradient of every
    /// floating input and trainable initializer; --loss says of which output.
    #[arg(long)]
    backward: bool,
    /// With --backward: the output to differentiate. Default: the model's training loss;
    /// a model without a training: section differentiates the sum of every floating
    /// output (and says which it seeded).
    #[arg(long, value_name = "OUTPUT", requires = "backward")]
    loss: Option<String>,
    /// Seed gradient for a differentiated output: NAME=FILE.npy (default all ones).
    #[arg(long = "grad", value_name = "NAME=FILE.npy")]
    grads: Vec<String>,
    /// Run fused and unfused and report the largest relative difference per output.
    #[arg(long)]
    verify_fusion: bool,
    /// Print less.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args)]
struct InspectArgs {
    /// The model: a .yaml model file or an .onnx file.
    model: PathBuf,
    /// Show the graph as written, without the fusion passes.
    #[arg(long)]
    no_fuse: bool,
    /// Switch one pass off by name (repeatable).
    #[arg(long = "disable-pass", value_name = "PASS")]
    disable_pass: Vec<String>,
    /// Also build the backward graph: its op counts, what it differentiates, its planned
    /// memory; --nodes, --dot and --emit-yaml then show it. Needs every symbolic dim bound.
    #[arg(long)]
    backward: bool,
    /// List the graph node by node: name, op (and what a fused node absorbed), input and
    /// output types.
    #[arg(long)]
    nodes: bool,
    /// Bind a symbolic dim: SYM=N (repeatable). Unbound symbols are shown as symbols.
    #[arg(long = "dim", value_name = "SYM=N")]
    dims: Vec<String>,
    /// Plan for an input's value (and shape) from a .npy file: NAME=FILE.npy. Needed for
    /// inputs whose values decide shapes (a Reshape's shape, a Slice's starts, ...).
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
    /// Write the graph (after passes) as Graphviz DOT, value types on the edges.
    #[arg(long, value_name = "FILE.dot")]
    dot: Option<PathBuf>,
    /// Write the graph (after passes) as a self-contained YAML model.
    #[arg(long, value_name = "FILE.yaml")]
    emit_yaml: Option<PathBuf>,
    /// Say why each MatMul and Softmax that was not fused was left alone.
    #[arg(long)]
    explain_fusion: bool,
}

#[derive(Args)]
struct BenchArgs {
    /// The model: a .yaml model file or an .onnx file.
    model: PathBuf,
    #[command(flatten)]
    common: Common,
    /// Timing samples taken (each of one or more steps, see the output).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Untimed steps first (plans, kernel compilation, caches).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Time a training step (forward, backward, optimizer) when the model has a
    /// training: section, else forward and backward.
    #[arg(long)]
    backward: bool,
    /// Write the results as JSON (one record per run, with the fields the PyTorch reference scripts write).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Seed for the random inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Feed an input from a .npy file (NAME=FILE.npy); the others get seeded random data.
    /// Needed for inputs whose values decide shapes (a Reshape's shape, ...).
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
    /// With --backward on a model with a training section: a data-parallel training step
    /// on this many GPUs, each with the model's batch (cuda backend, NCCL).
    #[arg(long)]
    gpus: Option<usize>,
    /// With --gpus: shard the optimizer state over the GPUs (ZeRO stage 1); reports
    /// each GPU's share.
    #[arg(long, requires = "gpus")]
    shard_optimizer: bool,
}

#[derive(Args)]
struct TrainArgs {
    /// The model: a .yaml model file or an .onnx file.
    model: PathBuf,
    #[command(flatten)]
    common: Common,
    /// Training data for an input, samples along the first axis: NAME=FILE.npy.
    /// Without any, the model trains on one batch of seeded random inputs.
    #[arg(long = "data", value_name = "NAME=FILE.npy")]
    data: Vec<String>,
    /// Held-out data, evaluated after each epoch (loss, and accuracy when the loss is a
    /// SoftmaxCrossEntropyLoss): NAME=FILE.npy.
    #[arg(long = "val-data", value_name = "NAME=FILE.npy")]
    val_data: Vec<String>,
    /// Samples per step (default: the model's batch dim); a last partial batch is dropped.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Passes over the data (default 1).
    #[arg(long, conflicts_with = "steps")]
    epochs: Option<usize>,
    /// Optimizer steps in all (instead of --epochs).
    #[arg(long)]
    steps: Option<usize>,
    /// Override the learning rate of the model's optimizer.
    #[arg(long)]
    lr: Option<f64>,
    /// The scalar output to minimise, over the model's training: loss. A model without a
    /// training: section (an .onnx file has none) then trains with Adam (lr 0.001 or --lr).
    #[arg(long, value_name = "OUTPUT", conflicts_with = "cross_entropy")]
    loss: Option<String>,
    /// Train OUTPUT (logits, classes along the last axis) with the mean softmax
    /// cross-entropy against a new int64 input `labels` of OUTPUT's shape without its last
    /// axis (feed it with --data labels=FILE.npy; -100 marks a position to ignore). For a
    /// language model, the labels are the next tokens. Adam (lr 0.001 or --lr) unless the
    /// model has a training: section
    #[arg(long, value_name = "OUTPUT")]
    cross_entropy: Option<String>,
    /// The axis of --cross-entropy's OUTPUT that holds the classes (negative counts from
    /// the end): 1 for `[N, C, H, W]` scores, as PyTorch's cross_entropy reads them.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true, requires = "cross_entropy")]
    class_axis: i64,
    /// Seed for shuffling (and for random inputs).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Save the trained initializers.
    #[arg(long, value_name = "FILE.safetensors")]
    save: Option<PathBuf>,
    /// Draw the training curves as SVG: the loss per step (raw and smoothed) and per
    /// epoch, and with --val-data the held-out loss and accuracy per epoch.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Draw the loss axis of --plot on a logarithmic scale.
    #[arg(long, requires = "plot")]
    plot_log: bool,
    /// Data-parallel training on this many GPUs (cuda backend, NCCL): each step's batch
    /// is split evenly over them and their gradients are averaged.
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Gradient accumulation: run each step's batch (each GPU's share of it with --gpus)
    /// as K equal micro-batches, one after another, and update once with their averaged
    /// gradients: the step of the whole batch in the memory of one micro-batch.
    #[arg(long, value_name = "K", default_value_t = 1)]
    accumulate: usize,
    /// With --gpus: each GPU keeps the optimizer state (Adam's moments, momentum) of its
    /// own 1/N shard of every parameter only (ZeRO stage 1), so a model whose optimizer
    /// state does not fit one GPU can train on several; the steps are the same.
    #[arg(long)]
    shard_optimizer: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    /// Keep training (and save) when the loss or a parameter becomes NaN or infinite; by
    /// default training stops there with an error naming the step (and the parameter),
    /// and no checkpoint with such values is written.
    #[arg(long)]
    allow_nonfinite: bool,
}

#[derive(Args)]
struct ConvertArgs {
    /// The model to convert: an .onnx file (or a .yaml model, written back normalized).
    model: PathBuf,
    /// The YAML file to write; large initializers go into <stem>.safetensors beside it.
    /// With --weights, the .onnx file to write.
    #[arg(long, short, value_name = "FILE.yaml")]
    output: PathBuf,
    /// Write the ONNX model back with these weights in place of its initializers (by
    /// name; `graphrun train --save` writes them), as a self-contained .onnx file
    #[arg(long, value_name = "FILE.safetensors")]
    weights: Option<PathBuf>,
}

/// A CLI failure: its message and the exit code it maps to.
struct Fail {
    code: u8,
    err: anyhow::Error,
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail {
            code: if e.is_user_error() { 2 } else { 1 },
            err: e.into(),
        }
    }
}

fn usage(msg: impl std::fmt::Display) -> Fail {
    Fail {
        code: 2,
        err: anyhow::anyhow!("{msg}"),
    }
}

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`graphrun ... | head`) as Unix tools do, instead of a
    // panic from println!.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let mut argv: Vec<String> = std::env::args().collect();
    // `graphrun MODEL ...` means `graphrun run MODEL ...`, global options before MODEL
    // included (`graphrun --max-memory 1G MODEL`).
    let subcommands = [
        "run", "inspect", "doctor", "bench", "train", "convert", "help",
    ];
    let mut at = 1;
    while let Some(a) = argv.get(at) {
        match a.as_str() {
            "--max-memory" | "--tune" => at += 2,
            "--allow-outside-files" => at += 1,
            a if a.starts_with("--max-memory=") || a.starts_with("--tune=") => at += 1,
            _ => break,
        }
    }
    if argv
        .get(at)
        .is_some_and(|a| !subcommands.contains(&a.as_str()) && !a.starts_with('-'))
    {
        argv.insert(at, "run".into());
    }
    let cli = match Cli::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match (cli.max_memory, std::env::var("GRAPHRUN_MAX_BYTES")) {
        (Some(b), _) => graphrun::tensor::set_max_bytes(b),
        (None, Ok(v)) => match graphrun::tensor::parse_size(&v) {
            Ok(b) => graphrun::tensor::set_max_bytes(b),
            Err(e) => {
                eprintln!("error: GRAPHRUN_MAX_BYTES: {e}");
                return ExitCode::from(2);
            }
        },
        (None, Err(_)) => {}
    }
    graphrun::files::set_allow_outside(cli.allow_outside_files);
    // One process is one run: no output may replace a file it reads.
    graphrun::files::guard_inputs(true);
    if !cli.tune.is_empty() {
        let mut t = graphrun::tuning();
        for kv in &cli.tune {
            if let Err(e) = t.apply(kv) {
                eprintln!("error: --tune: {e}");
                return ExitCode::from(2);
            }
        }
        graphrun::set_tuning(t);
    }
    let r = match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::Inspect(a) => inspect(a),
        Cmd::Doctor => doctor(),
        Cmd::Bench(a) => bench(a),
        Cmd::Train(a) => train(a),
        Cmd::Convert(a) => convert(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {:#}", f.err);
            ExitCode::from(f.code)
        }
    }
}

fn parse_kv(s: &str, flag: &str) -> Result<(String, String), Fail> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(usage(format!("{flag} expects NAME=VALUE, got '{s}'"))),
    }
}

/// The `--dim SYM=N` flags, each naming one of `g`'s symbolic dims (a typo would
/// otherwise be ignored and the model run at its default size).
fn parse_dims(g: &graphrun::Graph, dims: &[String]) -> Result<BTreeMap<String, usize>, Fail> {
    let mut symbols = g.symbols();
    for k in g.dims.keys() {
        if !symbols.contains(k) {
            symbols.push(k.clone());
        }
    }
    let mut out = BTreeMap::new();
    for d in dims {
        let (k, v) = parse_kv(d, "--dim")?;
        if !symbols.contains(&k) {
            return Err(usage(if symbols.is_empty() {
                format!("--dim {k}: the model has no symbolic dims")
            } else {
                format!(
                    "--dim {k}: the model has no symbolic dim '{k}'; its symbolic dims are {}",
                    symbols.join(", ")
                )
            }));
        }
        let n: usize = v.parse().map_err(|_| {
            usage(format!(
                "--dim {k}={v}: the size must be a non-negative integer"
            ))
        })?;
        if let Some(prev) = out.insert(k.clone(), n) {
            if prev != n {
                return Err(usage(format!("--dim {k} is given twice ({prev} and {n})")));
            }
        }
    }
    Ok(out)
}

fn backend_of(c: &Common) -> BackendKind {
    BackendKind::parse(&c.backend).expect("clap restricts the values")
}

/// What an ONNX import may need to know of the shapes the command will feed (a
/// recurrence is unrolled when it is imported, so its length must be known then): the
/// `--dim` sizes and the shapes of the `NAME=FILE.npy` files, whose first axis is
/// `batch` where that is given (training data). Malformed flags are left to the
/// command's own checks, which name them.
fn import_shapes(
    dims: &[String],
    files: &[String],
    batch: Option<usize>,
) -> graphrun::onnx::ImportOptions {
    let mut o = graphrun::onnx::ImportOptions::default();
    for d in dims {
        if let Some((k, Ok(n))) = d.split_once('=').map(|(k, v)| (k, v.parse())) {
            o.dims.insert(k.to_string(), n);
        }
    }
    for f in files {
        let Some((name, file)) = f.split_once('=') else {
            continue;
        };
        if let Ok(mut shape) = Tensor::npy_shape(Path::new(file), &format!("input '{name}'")) {
            if let (Some(b), Some(first)) = (batch, shape.first_mut()) {
                *first = b;
            }
            o.input_shapes.insert(name.to_string(), shape);
        }
    }
    o
}

/// Loads the model and applies `--dtype`, an ONNX file imported as `opts` says
/// (`import_shapes`: what the command will feed).
fn load_as(
    path: &Path,
    dtype: Option<&str>,
    opts: &graphrun::onnx::ImportOptions,
) -> Result<Model, Fail> {
    let mut m = Model::load_with(path, opts)?;
    if let Some(d) = dtype.and_then(DType::parse).filter(|d| *d != DType::F32) {
        m.graph = exec::with_float_dtype(&m.graph, d);
    }
    Ok(m)
}

/// The graph the passes make (or the graph as written with --no-fuse).
fn optimized(
    g: &graphrun::Graph,
    no_fuse: bool,
    disabled: &[String],
    training: bool,
) -> Result<(graphrun::Graph, Option<passes::Report>), Fail> {
    if no_fuse {
        return Ok((g.clone(), None));
    }
    let (g2, report) = passes::optimize(g, &pass_options(no_fuse, disabled, training))?;
    Ok((g2, Some(report)))
}

/// A graph that only runs forward: its weights frozen into constants that fold into each
/// other (`passes::freeze`: BatchNormalization into the Conv before it), and on CUDA its
/// f32 weights K-major (`passes::weight_layout`; `--tune k_major_weights=0` leaves them
/// as written).
fn forward_only(g: graphrun::Graph, c: &Common, forward: bool) -> Result<graphrun::Graph, Fail> {
    if !forward {
        return Ok(g);
    }
    let g = if c.no_fuse {
        g
    } else {
        passes::freeze(&g, &pass_options(false, &c.disable_pass, false))?.0
    };
    let on = graphrun::tuning().k_major_weights;
    Ok(if on && backend_of(c) == BackendKind::Cuda {
        passes::weight_layout::k_major_weights(&g).0
    } else {
        g
    })
}

/// The pass options for generated backward graphs: cleanup always, fusion unless
/// --no-fuse (so that --no-fuse gives a graph of plain ops throughout).
fn pass_options(no_fuse: bool, disabled: &[String], training: bool) -> passes::PassOptions {
    let mut disabled = disabled.to_vec();
    if no_fuse {
        disabled.extend([
            "attention_fusion".to_string(),
            "matmul_epilogue_fusion".into(),
        ]);
    }
    passes::PassOptions {
        disabled,
        training,
        ..Default::default()
    }
}

fn session_options(c: &Common, dims: BTreeMap<String, usize>, training: bool) -> SessionOptions {
    SessionOptions {
        backend: backend_of(c),
        dims,
        training,
        passes: pass_options(c.no_fuse, &c.disable_pass, training),
        // Each command optimizes the graph itself, to report what the passes did.
        fuse: false,
        tf32: c.dtype.as_deref() == Some("tf32"),
        device: 0,
        allow_nonfinite: false,
        shard_optimizer: false,
    }
}

/// Reads `--grad NAME=FILE.npy` seeds.
fn read_seeds(specs: &[String], g: &graphrun::Graph) -> Result<HashMap<String, Tensor>, Fail> {
    let mut seeds = HashMap::new();
    for spec in specs {
        let (name, file) = parse_kv(spec, "--grad")?;
        if !g.outputs.contains(&name) {
            return Err(usage(format!(
                "--grad {name}: '{name}' is not an output of the model (its outputs: {})",
                g.outputs.join(", ")
            )));
        }
        if seeds
            .insert(
                name.clone(),
                Tensor::read_npy_as(Path::new(&file), &format!("--grad {name}"))?,
            )
            .is_some()
        {
            return Err(usage(format!("--grad {name} is given twice")));
        }
    }
    Ok(seeds)
}

/// Relative L2 difference ‖a − b‖/‖b‖ (NaN when either holds NaN).
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (num, den) = graphrun::testing::l2_diff_and_norm(a, b);
    if den > 0.0 {
        num / den
    } else {
        num
    }
}

fn run(a: RunArgs) -> Result<(), Fail> {
    if !a.grads.is_empty() && !a.backward {
        return Err(usage("--grad seeds the backward pass: add --backward"));
    }
    if a.verify_fusion && a.common.no_fuse {
        return Err(usage(
            "--verify-fusion compares fused with unfused: drop --no-fuse",
        ));
    }
    let shapes = import_shapes(&a.common.dims, &a.inputs, None);
    let model = load_as(&a.model, a.common.dtype.as_deref(), &shapes)?;
    let g = &model.graph;
    let dims = parse_dims(g, &a.common.dims)?;
    // Output file names must stay inside --out-dir.
    if a.out_dir.is_some() {
        for o in &g.outputs {
            if o.contains(['/', '\\']) || o == "." || o == ".." || o.is_empty() {
                return Err(usage(format!(
                    "output '{o}' cannot be written as a file name under --out-dir"
                )));
            }
        }
    }
    if let Some(dir) = &a.out_dir {
        files::check_output_dir(dir).map_err(usage)?;
        for o in &g.outputs {
            files::check_output_name(dir, &format!("{o}.npy")).map_err(usage)?;
        }
        if a.backward {
            files::check_output_dir(&dir.join("grads")).map_err(usage)?;
        }
    }
    let seeds = read_seeds(&a.grads, g)?;
    // What --backward differentiates: --loss, else the model's training loss, else
    // (None) the sum of every floating output.
    let loss = match (&a.loss, &g.training) {
        (Some(l), _) => Some((l.clone(), "chosen by --loss")),
        (None, Some(t)) if a.backward => Some((
            t.loss.clone(),
            "the model's training loss (--loss OUTPUT picks another)",
        )),
        _ => None,
    };
    if let Some((l, why)) = &loss {
        if !g.outputs.contains(l) {
            return Err(usage(format!(
                "--loss {l}: '{l}' is not an output of the model (its outputs: {})",
                g.outputs.join(", ")
            )));
        }
        if let Some(other) = seeds.keys().find(|o| *o != l) {
            return Err(usage(format!(
                "--grad {other}: the backward differentiates '{l}' ({why}), so only it takes a seed; \
                 give --loss {other} to differentiate '{other}' instead"
            )));
        }
    }
    let grad_outputs: Vec<String> = loss.iter().map(|(l, _)| l.clone()).collect();
    // The backend is set up first, so that a missing device is the one line printed.
    let opts = session_options(&a.common, dims.clone(), false);
    let (fused, _) = optimized(g, a.common.no_fuse, &a.common.disable_pass, false)?;
    let fused = forward_only(fused, &a.common, !a.backward)?;
    let mut session = Session::new(fused, opts.clone())?;
    session.set_backward_outputs(&grad_outputs)?;
    let mut feeds: HashMap<String, Tensor> = HashMap::new();
    for spec in &a.inputs {
        let (name, _, _, t) = read_input_npy(g, spec, "--input", a.common.dtype.is_some(), |n| {
            feeds.contains_key(n)
        })?;
        feeds.insert(name, t);
    }
    // Inputs with a default (an ONNX initializer listed as an input) take it unless fed.
    exec::fill_defaults(g, &mut feeds);
    let fill_all = a.inputs.is_empty();
    if !fill_all && !a.random_inputs {
        let missing: Vec<&str> = g
            .inputs
            .iter()
            .map(|i| i.name.as_str())
            .filter(|n| !feeds.contains_key(*n))
            .collect();
        if !missing.is_empty() {
            return Err(usage(format!(
                "no --input for {}; give every input, or add --random-inputs to fill the rest",
                missing
                    .iter()
                    .map(|m| format!("'{m}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    need_plan_inputs(g, &feeds)?;
    let bound = exec::bind_dims(g, &feeds, &dims)?;
    let mut filled = vec![];
    for i in &g.inputs {
        if !feeds.contains_key(&i.name) {
            let shape = exec::concrete_shape(i, &bound)?;
            feeds.insert(i.name.clone(), exec::random_input(i, &shape, a.seed)?);
            filled.push(format!(
                "{} {}{}",
                i.name,
                i.dtype,
                graphrun::tensor::fmt_shape(&shape)
            ));
        }
    }
    if !filled.is_empty() && !a.quiet {
        eprintln!(
            "filling {} with seeded random data (seed {})",
            filled.join(", "),
            a.seed
        );
    }
    if a.backward {
        let plan = session.plan_for(&feeds)?;
        let types = &plan.types;
        let seed_of = |o: &str| {
            if seeds.contains_key(o) {
                format!("'{o}' (seeded from --grad)")
            } else {
                format!("'{o}' (seeded with ones)")
            }
        };
        let what = match &loss {
            Some((l, why)) => {
                if !types[l].dtype.is_float() {
                    return Err(usage(format!(
                        "--backward: '{l}' ({why}) is {}, not a floating value to differentiate",
                        types[l]
                    )));
                }
                format!("gradients of {}, {why}", seed_of(l))
            }
            None => {
                let floats: Vec<String> = g
                    .outputs
                    .iter()
                    .filter(|o| types[*o].dtype.is_float())
                    .map(|o| seed_of(o))
                    .collect();
                format!(
                    "gradients of the sum of every floating output: {} (the model has no \
                     training loss; --loss OUTPUT differentiates one)",
                    floats.join(", ")
                )
            }
        };
        if !a.quiet {
            eprintln!("{what}");
        }
    }
    let (outs, grads) = if a.backward {
        let r = session.backward(&feeds, &seeds)?;
        (r.outputs, r.grads)
    } else {
        (session.run(&feeds)?, vec![])
    };
    if a.verify_fusion {
        let backward = a.backward.then_some(&grad_outputs[..]);
        verify_fusion(g, opts, &feeds, &seeds, backward, &outs, &grads)?;
    }
    // One line per output, then per gradient: dtype, shape and (unless --quiet) a summary.
    for (prefix, list) in [("", &outs), ("grad ", &grads)] {
        for (name, t) in list {
            let shape = graphrun::tensor::fmt_shape(t.shape());
            if a.quiet {
                println!("{prefix}{name}: {} {shape}", t.dtype());
            } else {
                println!("{prefix}{name}: {} {shape} {}", t.dtype(), t.summary());
            }
        }
    }
    if let Some(dir) = &a.out_dir {
        for (name, _) in &grads {
            if name.contains(['/', '\\']) || name == "." || name == ".." {
                return Err(usage(format!(
                    "gradient of '{name}' cannot be written as a file name under --out-dir"
                )));
            }
        }
        let mut files: Vec<(PathBuf, &Tensor)> = outs
            .iter()
            .map(|(n, t)| (dir.join(format!("{n}.npy")), t))
            .collect();
        files.extend(
            grads
                .iter()
                .map(|(n, t)| (dir.join("grads").join(format!("{n}.npy")), t)),
        );
        write_files(&files)?;
    }
    Ok(())
}

/// Runs the unfused graph on the same inputs and compares every output, and with
/// --backward (`backward`: the outputs differentiated, empty for every floating one)
/// every gradient (SPEC §5).
fn verify_fusion(
    g: &graphrun::Graph,
    mut opts: SessionOptions,
    feeds: &HashMap<String, Tensor>,
    seeds: &HashMap<String, Tensor>,
    backward: Option<&[String]>,
    fused: &[(String, Tensor)],
    fused_grads: &[(String, Tensor)],
) -> Result<(), Fail> {
    opts.passes = pass_options(true, &[], false);
    let mut plain = Session::new(g.clone(), opts)?;
    plain.set_backward_outputs(backward.unwrap_or_default())?;
    let (outs, grads) = if backward.is_some() {
        let r = plain.backward(feeds, seeds)?;
        (r.outputs, r.grads)
    } else {
        (plain.run(feeds)?, vec![])
    };
    let mut worst = vec![];
    let pairs = fused
        .iter()
        .zip(&outs)
        .map(|(a, b)| ("", a, b))
        .chain(fused_grads.iter().zip(&grads).map(|(a, b)| ("grad ", a, b)));
    for (what, (name, a), (_, b)) in pairs {
        let rel = rel_diff(a, b);
        let tol = match a.dtype() {
            DType::F64 => 1e-10,
            DType::F32 => 1e-5,
            _ => 1e-2,
        };
        let ok = rel <= tol; // NaN fails
        println!(
            "verify-fusion {what}{name}: max relative difference {rel:.3e} (tolerance {tol:.0e}) {}",
            if ok { "ok" } else { "FAILED" }
        );
        if !ok {
            worst.push(format!("{what}{name}"));
        }
    }
    if worst.is_empty() {
        Ok(())
    } else {
        Err(Fail {
            code: 1,
            err: anyhow::anyhow!(
                "--verify-fusion: fused and unfused graphs differ beyond tolerance in {}",
                worst.join(", ")
            ),
        })
    }
}

/// Writes every .npy file or none (folders made as needed, and removed again on failure).
fn write_files(files: &[(PathBuf, &Tensor)]) -> Result<(), Fail> {
    let mut out = files::Outputs::new();
    for (path, t) in files {
        if let Some(dir) = path.parent() {
            out.create_dir(dir)?;
        }
        out.stage(path, |w| t.write_npy_to(w))?;
    }
    out.commit()?;
    Ok(())
}

/// Checks every output file a command will write before it does any work, so that a bad
/// path is reported at once and a failed run leaves nothing behind.
fn check_outputs<'a>(paths: impl IntoIterator<Item = &'a PathBuf>) -> Result<(), Fail> {
    for p in paths {
        files::check_output(p).map_err(usage)?;
    }
    Ok(())
}

fn fmt_bytes(b: usize) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}

fn fmt_count(n: f64) -> String {
    if n >= 1e12 {
        format!("{:.2} T", n / 1e12)
    } else if n >= 1e9 {
        format!("{:.2} G", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2} M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.2} k", n / 1e3)
    } else {
        format!("{n}")
    }
}

fn inspect(a: InspectArgs) -> Result<(), Fail> {
    let model = load_as(&a.model, None, &import_shapes(&a.dims, &a.inputs, None))?;
    let emitted: Vec<PathBuf> = a
        .emit_yaml
        .iter()
        .flat_map(|p| graphrun::graph::yaml::save_paths(&model.graph, p))
        .collect();
    check_outputs(a.dot.iter().chain(&emitted))?;
    let g = &model.graph;
    let dims = parse_dims(&model.graph, &a.dims)?;
    println!("model: {} ({})", g.name, a.model.display());
    for i in &g.inputs {
        let shape: Vec<String> = i.shape.iter().map(|d| d.to_string()).collect();
        println!("  input  {} {}[{}]", i.name, i.dtype, shape.join(", "));
    }
    println!("  output {}", g.outputs.join(", "));
    let pbytes: usize = g.initializers.iter().map(|i| i.tensor.size_bytes()).sum();
    let trainable: usize = g
        .initializers
        .iter()
        .filter(|i| i.trainable)
        .map(|i| i.tensor.numel())
        .sum();
    println!(
        "parameters: {} ({} trainable) in {} initializers, {}",
        g.param_count(),
        trainable,
        g.initializers.len(),
        fmt_bytes(pbytes)
    );
    let counts = |g: &graphrun::Graph| {
        g.op_counts()
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!("before passes: {} nodes: {}", g.nodes.len(), counts(g));
    let (fused, report) = optimized(g, a.no_fuse, &a.disable_pass, false)?;
    match &report {
        None => println!("passes: off (--no-fuse)"),
        Some(r) => {
            println!("passes:");
            for line in r.to_string().lines() {
                println!("  {line}");
            }
            // Where each rule fired, in order (a long log is cut: the counts above are whole).
            const SHOWN: usize = 40;
            if !r.log.is_empty() {
                println!("rules applied:");
                for line in r.log.iter().take(SHOWN) {
                    println!("  {line}");
                }
                if r.log.len() > SHOWN {
                    println!("  ... and {} more", r.log.len() - SHOWN);
                }
            }
        }
    }
    println!(
        "after passes: {} nodes: {}",
        fused.nodes.len(),
        counts(&fused)
    );
    if a.explain_fusion {
        match &report {
            Some(r) if r.explain.is_empty() => {
                println!("explain-fusion: every MatMul and Softmax was fused")
            }
            Some(r) => {
                println!("explain-fusion:");
                for e in &r.explain {
                    println!("  {e}");
                }
            }
            None => println!("explain-fusion: passes are off (--no-fuse)"),
        }
    }
    let g = &fused;
    let quote = |v: &[String]| {
        v.iter()
            .map(|s| format!("'{s}'"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // Sizes: the --input shapes and --dim (the user's), then the model's dims: defaults;
    // and the --input values of inputs that decide shapes.
    let given = read_inputs(g, &a.inputs, false)?;
    need_plan_inputs(g, &given)?;
    let values = exec::plan_values(g, &graphrun::graph::infer::plan_time_inputs(g), &given)?;
    let user = {
        let mut plain = fused.clone();
        plain.dims.clear();
        exec::bind_dims(&plain, &given, &dims)?
    };
    let bound = exec::bind_dims(g, &given, &dims)?;
    let symbols = g.symbols();
    let defaulted: Vec<String> = symbols
        .iter()
        .filter(|s| bound.contains_key(*s) && !user.contains_key(*s))
        .cloned()
        .collect();
    let unbound: Vec<String> = symbols
        .iter()
        .filter(|s| !bound.contains_key(*s))
        .cloned()
        .collect();
    // Types with the symbols the user did not bind left as symbols.
    let ev = &graphrun::backends::cpu::HOST_EVAL;
    let sym = graphrun::graph::infer::symbolic::infer_symbolic(g, &user, &values, ev);
    match &sym {
        Ok(types) => {
            println!(
                "output types{}:",
                if symbols.iter().any(|s| !user.contains_key(s)) {
                    " (unbound symbols as symbols)"
                } else {
                    ""
                }
            );
            for o in &g.outputs {
                println!("  {o}: {}", types[o]);
            }
        }
        Err(e) => println!("  shapes: not shown ({e})"),
    }
    let mut backward_graph = None;
    if unbound.is_empty() {
        let shapes: HashMap<String, Vec<usize>> = g
            .inputs
            .iter()
            .map(|i| Ok((i.name.clone(), exec::concrete_shape(i, &bound)?)))
            .collect::<Result<_, Error>>()?;
        let key = exec::PlanKey {
            values: values.clone(),
            shapes,
        };
        let none = std::collections::HashSet::new();
        let plan = graphrun::Plan::for_key(g, &key, &none)?;
        let bind: Vec<String> = bound
            .iter()
            .filter(|(k, _)| symbols.contains(k))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!(
            "plan ({}): {}, {}FLOP per run",
            if bind.is_empty() {
                "static shapes".into()
            } else {
                bind.join(", ")
            },
            counted(plan.steps.len(), "step"),
            fmt_count(plan.flops as f64)
        );
        if !defaulted.is_empty() {
            println!(
                "  {} from the model's dims: defaults (--dim chooses other sizes)",
                quote(&defaulted)
            );
        }
        println!(
            "  peak activation memory {} (without buffer reuse: {}), weights {}",
            fmt_bytes(plan.peak_bytes()),
            fmt_bytes(plan.naive_bytes),
            fmt_bytes(plan.weight_bytes)
        );
        if a.backward {
            backward_graph = Some(inspect_backward(&a, g, &key, &plan, &counts)?);
        }
    } else {
        if a.backward {
            return Err(usage(format!(
                "symbolic dim{} {} not bound: the backward graph is built for sizes, so give --dim {}=N (or a default under dims:)",
                if unbound.len() > 1 { "s" } else { "" },
                quote(&unbound),
                unbound[0]
            )));
        }
        // No plan without sizes; what every value takes is a formula of the symbols.
        let weights: usize = g.initializers.iter().map(|i| i.tensor.size_bytes()).sum();
        let mut total = graphrun::graph::infer::symbolic::Polynomial::default();
        let mut whole = true;
        if let Ok(types) = &sym {
            let values = g
                .inputs
                .iter()
                .map(|i| &i.name)
                .chain(g.nodes.iter().flat_map(|n| n.outputs.iter()))
                .filter(|v| !v.is_empty());
            for v in values {
                match types.get(v).and_then(|t| t.bytes()) {
                    Some(m) => total.add(&m),
                    None => whole = false,
                }
            }
        }
        println!(
            "plan: not made, symbolic dim{} {} ha{} no size (give --dim {}=N to plan)",
            if unbound.len() > 1 { "s" } else { "" },
            quote(&unbound),
            if unbound.len() > 1 { "ve" } else { "s" },
            unbound[0]
        );
        if sym.is_ok() && whole {
            println!(
                "  activation memory at most {} bytes (every value held at once; buffer reuse needs sizes), weights {}",
                total.format(|c| c.to_string()),
                fmt_bytes(weights)
            );
        } else {
            println!(
                "  activation memory: depends on {} in a way not shown without sizes, weights {}",
                quote(&unbound),
                fmt_bytes(weights)
            );
        }
    }
    // What --nodes, --dot and --emit-yaml show: the backward graph with --backward (built
    // for the bound sizes, so its types are numbers), else the forward graph.
    let (g, types) = match &backward_graph {
        Some(bg) => (
            bg,
            graphrun::graph::infer::symbolic::infer_symbolic(bg, &bound, &values, ev)
                .unwrap_or_default(),
        ),
        None => (g, sym.unwrap_or_default()),
    };
    if a.nodes {
        print_nodes(g, &types)?;
    }
    // Every file or none. Symbols stay symbols in --emit-yaml (and the model's defaults
    // its defaults).
    let mut out = files::Outputs::new();
    if let Some(p) = &a.dot {
        let text = graphrun::graph::dot::to_dot(g, &types);
        out.stage(p, |w| w.write_all(text.as_bytes()))?;
    }
    if let Some(p) = &a.emit_yaml {
        graphrun::graph::yaml::stage(g, p, &mut out)?;
    }
    out.commit()?;
    for p in a.dot.iter().chain(&a.emit_yaml) {
        println!("wrote {}", p.display());
    }
    Ok(())
}

/// `inspect --nodes`: every node in execution order with its op (and what a fused node
/// absorbed) and the types of what it reads and writes.
fn print_nodes(
    g: &graphrun::Graph,
    types: &HashMap<String, graphrun::graph::infer::symbolic::SymType>,
) -> Result<(), Fail> {
    let ty = |v: &str| match types.get(v) {
        Some(t) => format!("{v}: {t}"),
        None if v.is_empty() => "(omitted)".to_string(),
        None => format!("{v}: ?"),
    };
    println!("nodes ({}, in execution order):", g.nodes.len());
    for ni in graphrun::graph::validate::topo_order(g)? {
        let n = &g.nodes[ni];
        let fused = graphrun::graph::dot::absorbed(n)
            .map(|w| format!(" ({w})"))
            .unwrap_or_default();
        println!("  {} {}{fused}", n.name, n.op.name());
        let ins: Vec<String> = n.inputs.iter().map(|i| ty(i)).collect();
        let outs: Vec<String> = n
            .outputs
            .iter()
            .filter(|o| !o.is_empty())
            .map(|o| ty(o))
            .collect();
        println!("    in   {}", ins.join(", "));
        println!("    out  {}", outs.join(", "));
    }
    Ok(())
}

/// `inspect --backward`: builds the backward graph of `g`'s floating outputs for the
/// plan's sizes and prints what it differentiates and its planned memory.
fn inspect_backward(
    a: &InspectArgs,
    g: &graphrun::Graph,
    key: &exec::PlanKey,
    plan: &graphrun::Plan,
    counts: &dyn Fn(&graphrun::Graph) -> String,
) -> Result<graphrun::Graph, Fail> {
    let shapes = &key.shapes;
    let none = std::collections::HashSet::new();
    let floats: Vec<String> = g
        .outputs
        .iter()
        .filter(|o| plan.types[*o].dtype.is_float())
        .cloned()
        .collect();
    let opts = graphrun::passes::autodiff::BackwardOptions {
        training: false,
        inputs: true,
        ..Default::default()
    };
    let bwd = graphrun::passes::autodiff::backward_with(g, &floats, shapes, &key.values, &opts)?;
    let (bg, _) = passes::optimize(&bwd.graph, &pass_options(a.no_fuse, &a.disable_pass, false))?;
    println!("backward graph: {} nodes: {}", bg.nodes.len(), counts(&bg));
    let seeds: Vec<String> = bwd
        .seeds
        .iter()
        .map(|(o, s)| format!("{o} by {s}"))
        .collect();
    println!("  seeded: {}", seeds.join(", "));
    let grads: Vec<String> = bwd.grads.iter().map(|(w, _)| w.clone()).collect();
    println!("  gradients of: {}", grads.join(", "));
    // Nodes that read a float but pass no gradient back.
    let constant: Vec<String> = g
        .nodes
        .iter()
        .filter(|n| graphrun::passes::autodiff::treated_as_constant(&n.op))
        .filter(|n| {
            n.inputs
                .iter()
                .any(|i| plan.types.get(i).is_some_and(|t| t.dtype.is_float()))
        })
        .map(|n| format!("'{}' ({})", n.name, n.op.name()))
        .collect();
    if !constant.is_empty() {
        println!(
            "  treated as constants (no gradient flows through them): {}",
            constant.join(", ")
        );
    }
    let mut all = key.clone();
    for (_, s) in &bwd.seeds {
        let info = bg.input(s).expect("seed input");
        all.shapes
            .insert(s.clone(), exec::concrete_shape(info, &BTreeMap::new())?);
    }
    let bplan = graphrun::Plan::for_key(&bg, &all, &none)?;
    // The baseline: every forward value held until the backward is done.
    let keep: std::collections::HashSet<String> = g
        .nodes
        .iter()
        .flat_map(|n| n.outputs.iter().cloned())
        .chain(g.inputs.iter().map(|i| i.name.clone()))
        .filter(|v| bplan.types.contains_key(v))
        .collect();
    let kplan = graphrun::Plan::for_key(&bg, &all, &keep)?;
    println!(
        "  plan: {}, {}FLOP per forward+backward",
        counted(bplan.steps.len(), "step"),
        fmt_count(bplan.flops as f64)
    );
    println!(
        "  peak activation memory forward+backward {} (keeping every forward value: {}; without buffer reuse: {}), weights {}",
        fmt_bytes(bplan.peak_bytes()),
        fmt_bytes(kplan.peak_bytes()),
        fmt_bytes(bplan.naive_bytes),
        fmt_bytes(bplan.weight_bytes)
    );
    Ok(bg)
}

/// `convert`: the model as loaded (no passes), written in the YAML format.
fn convert(a: ConvertArgs) -> Result<(), Fail> {
    if let Some(w) = &a.weights {
        return convert_weights(&a, w);
    }
    let model = Model::load(&a.model)?;
    if a.output
        .extension()
        .is_none_or(|e| e != "yaml" && e != "yml")
    {
        return Err(usage(format!(
            "convert writes YAML: -o {} must end in .yaml",
            a.output.display()
        )));
    }
    check_outputs(&graphrun::graph::yaml::save_paths(&model.graph, &a.output))?;
    let side = model.save_with_side_file(&a.output)?;
    let g = &model.graph;
    println!(
        "wrote {} ({} nodes, {} inputs, {} initializers, {} parameters)",
        a.output.display(),
        g.nodes.len(),
        g.inputs.len(),
        g.initializers.len(),
        g.param_count()
    );
    if let Some((file, n)) = side {
        let bytes = std::fs::metadata(&file)
            .map(|m| m.len() as usize)
            .unwrap_or(0);
        println!(
            "wrote {} ({n} large initializer{}, {}; the YAML reads them from it, so keep the two together)",
            file.display(),
            if n == 1 { "" } else { "s" },
            fmt_bytes(bytes)
        );
    }
    Ok(())
}

/// `convert MODEL.onnx --weights W.safetensors -o OUT.onnx`.
fn convert_weights(a: &ConvertArgs, weights: &Path) -> Result<(), Fail> {
    let onnx = |p: &Path| {
        p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
    };
    if !onnx(&a.model) || !onnx(&a.output) {
        return Err(usage(
            "convert --weights writes an ONNX model with trained weights: MODEL and -o must be .onnx files",
        ));
    }
    check_outputs([&a.output])?;
    // Checks the model as graphrun reads it before writing anything.
    Model::load(&a.model)?;
    let bytes = files::read_bytes(&a.model, "the model")?;
    let trained = Tensor::read_safetensors(weights)?;
    let base = a.model.parent().map(Path::to_path_buf).unwrap_or_default();
    let (out, w) = graphrun::onnx::with_weights(&bytes, &base, &trained)?;
    let mut files = files::Outputs::new();
    files.stage(&a.output, |f| f.write_all(&out))?;
    files.commit()?;
    println!(
        "wrote {} ({} initializers from {}{})",
        a.output.display(),
        w.replaced,
        weights.display(),
        if w.derived.is_empty() {
            String::new()
        } else {
            format!(", and {} derived from them", w.derived.join(", "))
        }
    );
    if !w.left_out.is_empty() {
        eprintln!(
            "not written (the model shares these values with others; each trained as its own): {}",
            w.left_out.join(", ")
        );
    }
    Ok(())
}

fn doctor() -> Result<(), Fail> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "cpu: {threads} threads (rayon pool {}), {}",
        rayon::current_num_threads(),
        cpu_features()
    );
    let gf = graphrun::backends::cpu::gemm_f32_gflops(1024, 10);
    println!("  f32 GEMM 1024³ (median of 10): {gf:.1} GFLOP/s");
    println!("cuda:");
    for line in graphrun::backends::cuda::doctor_lines() {
        println!("  {line}");
    }
    println!("wgpu:");
    for line in graphrun::backends::wgpu::doctor_lines() {
        println!("  {line}");
    }
    println!("--backend default: cpu");
    Ok(())
}

fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let mut f = vec![];
        if std::arch::is_x86_feature_detected!("avx2") {
            f.push("avx2");
        }
        if std::arch::is_x86_feature_detected!("fma") {
            f.push("fma");
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            f.push("avx512f");
        }
        format!("x86_64 [{}]", f.join(" "))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::env::consts::ARCH.to_string()
    }
}

fn bench(a: BenchArgs) -> Result<(), Fail> {
    if a.iters == 0 {
        return Err(usage("--iters must be at least 1"));
    }
    let shapes = import_shapes(&a.common.dims, &a.inputs, None);
    let mut model = load_as(&a.model, a.common.dtype.as_deref(), &shapes)?;
    check_outputs(&a.json)?;
    let dims = parse_dims(&model.graph, &a.common.dims)?;
    let mut given = read_inputs(&model.graph, &a.inputs, a.common.dtype.is_some())?;
    exec::fill_defaults(&model.graph, &mut given);
    need_plan_inputs(&model.graph, &given)?;
    let feeds = with_random_inputs(&model.graph, given.clone(), &dims, a.seed)?;
    // --backward: a training step (forward, loss, backward, optimizer) when the model
    // has a training section, as ../shared/bench's `train` pass; else forward+backward.
    let train = a.backward && model.graph.training.is_some();
    // The forward pass is inference, as the reference's `fwd` (the model's outputs under
    // no_grad, no loss): the training loss is left out when the model has other outputs,
    // and dead-node elimination then drops its nodes.
    let g = &mut model.graph;
    if let (false, Some(t)) = (a.backward, &g.training) {
        if g.outputs.iter().any(|o| *o != t.loss) {
            let loss = t.loss.clone();
            g.outputs.retain(|o| *o != loss);
            g.training = None;
        }
    }
    let pass = match (a.backward, train) {
        (false, _) => "fwd",
        (true, true) => "train",
        (true, false) => "fwd+bwd",
    };
    let opts = session_options(&a.common, dims.clone(), train);
    let (fused, _) = optimized(
        &model.graph,
        a.common.no_fuse,
        &a.common.disable_pass,
        train,
    )?;
    let fused = forward_only(fused, &a.common, !a.backward)?;
    if let Some(gpus) = a.gpus {
        if !train {
            return Err(usage(
                "--gpus times a data-parallel training step: it needs --backward and a model \
                 with a training section",
            ));
        }
        return bench_parallel(&a, gpus, &model, fused, opts, &dims, &given);
    }
    let mut session = Session::new(fused, opts)?;
    // Inputs stay on the device and nothing is downloaded, as in the PyTorch reference
    // (its inputs live on the device; no host copies are timed).
    session.set_static_feeds(true);
    let none = HashMap::new();
    let once = |s: &mut Session| -> Result<(), Fail> {
        match (a.backward, train) {
            (false, _) => drop(s.run(&feeds)?),
            (true, true) => drop(s.train_step(&feeds)?),
            (true, false) => drop(s.backward(&feeds, &none)?),
        }
        Ok(())
    };
    // The plan that `once` runs (its peak and FLOPs are reported).
    let plan = match (a.backward, train) {
        (false, _) => session.plan_for(&feeds)?,
        (true, true) => session.train_graph(&feeds)?.1.clone(),
        (true, false) => session.backward_graph(&feeds)?.1.clone(),
    };
    let (med, min, max, group) =
        time_steps(a.warmup, a.iters, &mut session, once, |s| Ok(s.sync()?))?;
    let tflops = plan.flops as f64 / (med * 1e-3) / 1e12;
    // (The scratch pool has grown to the step's needs by now: it never shrinks.)
    let held = session.held_bytes();
    let peak_mib = (plan.peak_bytes() + plan.weight_bytes + held) as f64 / (1024.0 * 1024.0);
    println!(
        "{}: {} on {}, {pass}, {} iterations",
        model.graph.name,
        a.model.display(),
        session.backend_name(),
        a.iters
    );
    println!(
        "  median {med:.3} ms  min {min:.3} ms  max {max:.3} ms  ({group} step{} per timing sample)",
        if group > 1 { "s" } else { "" }
    );
    println!(
        "  {:.3} TFLOP/s ({}FLOP per iteration)",
        tflops,
        fmt_count(plan.flops as f64)
    );
    println!(
        "  peak memory {peak_mib:.1} MiB (planned activations + weights; {:.1} MiB of it scratch and workspaces)",
        held as f64 / (1024.0 * 1024.0)
    );
    // The per-node profile: one more set of runs, each node synchronized and timed.
    session.set_profiling(true);
    let prof_iters = a.iters.min(5);
    for _ in 0..prof_iters {
        once(&mut session)?;
    }
    let mut prof = session.take_profile();
    let total: f64 = prof.iter().map(|p| p.2).sum::<f64>().max(1e-12);
    prof.sort_by(|x, y| y.2.total_cmp(&x.2));
    // Columns as wide as their longest entry, so that long node names do not push the
    // numbers out of line.
    let nw = prof
        .iter()
        .map(|p| p.0.chars().count())
        .max()
        .unwrap_or(0)
        .max(4);
    let ow = prof.iter().map(|p| p.1.len()).max().unwrap_or(0).max(2);
    println!(
        "  {:<nw$}  {:<ow$}  {:>10}  {:>6}",
        "node", "op", "ms/iter", "share"
    );
    for (name, op, secs) in &prof {
        println!(
            "  {:<nw$}  {:<ow$}  {:>10.4}  {:>5.1}%",
            name,
            op,
            secs * 1e3 / prof_iters as f64,
            100.0 * secs / total
        );
    }
    if let Some(p) = &a.json {
        let dtype = a.common.dtype.clone().unwrap_or_else(|| "f32".into());
        let nodes: Vec<String> = prof
            .iter()
            .map(|(n, op, secs)| {
                format!(
                    "{{\"node\": {:?}, \"op\": \"{op}\", \"ms\": {}}}",
                    n,
                    secs * 1e3 / prof_iters as f64
                )
            })
            .collect();
        let json = format!(
            "{{\"results\": [{{\"workload\": {:?}, \"dtype\": \"{}\", \"mode\": \"graphrun\", \"pass\": \"{pass}\", \"backend\": \"{}\", \"ms\": {med}, \"ms_min\": {min}, \"ms_max\": {max}, \"tflops\": {tflops}, \"peak_mib\": {peak_mib}, \"status\": \"ok\", \"profile\": [{}]}}]}}\n",
            model.graph.name,
            dtype,
            session.backend_name(),
            nodes.join(", ")
        );
        write_atomic(p, |w| w.write_all(json.as_bytes()))?;
    }
    Ok(())
}

/// Times `step` on `target` after `warmup` steps: `iters` samples, each `group` steps issued
/// back to back and then waited for (`sync`), so that short steps are timed as the device
/// runs them rather than by one launch-and-wait each (PyTorch's CUDA-event timing of
/// back-to-back iterations measures the same). `group` makes a sample about 1 ms (at most
/// 50). Returns the median, min and max ms per step, and `group`.
fn time_steps<T>(
    warmup: usize,
    iters: usize,
    target: &mut T,
    mut step: impl FnMut(&mut T) -> Result<(), Fail>,
    mut sync: impl FnMut(&mut T) -> Result<(), Fail>,
) -> Result<(f64, f64, f64, usize), Fail> {
    for _ in 0..warmup {
        step(target)?;
    }
    sync(target)?;
    let t0 = std::time::Instant::now();
    step(target)?;
    sync(target)?;
    let one = t0.elapsed().as_secs_f64();
    let group = ((1e-3 / one.max(1e-9)).ceil() as usize).clamp(1, 50);
    let mut times = vec![];
    for _ in 0..iters {
        let t0 = std::time::Instant::now();
        for _ in 0..group {
            step(target)?;
        }
        sync(target)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3 / group as f64);
    }
    times.sort_by(|x, y| x.total_cmp(y));
    Ok((
        times[times.len() / 2],
        times[0],
        times[times.len() - 1],
        group,
    ))
}

/// `bench --backward --gpus N`: a data-parallel training step, each GPU with the model's
/// batch (its own seeded inputs), timed like `bench`. Prints the step time and the
/// throughput in samples per second.
fn bench_parallel(
    a: &BenchArgs,
    gpus: usize,
    model: &Model,
    fused: graphrun::Graph,
    opts: SessionOptions,
    dims: &BTreeMap<String, usize>,
    given: &HashMap<String, Tensor>,
) -> Result<(), Fail> {
    if gpus == 0 {
        return Err(usage("--gpus must be at least 1"));
    }
    let shards: Vec<std::sync::Arc<HashMap<String, Tensor>>> = (0..gpus)
        .map(|r| {
            with_random_inputs(&model.graph, given.clone(), dims, a.seed + r as u64)
                .map(std::sync::Arc::new)
        })
        .collect::<Result<_, _>>()?;
    let per_gpu = shards[0]
        .values()
        .next()
        .and_then(|t| t.shape().first().copied())
        .unwrap_or(1);
    let opts = SessionOptions {
        shard_optimizer: a.shard_optimizer,
        ..opts
    };
    let mut dp = graphrun::DataParallel::new(fused, opts, gpus).map_err(|e| flagged(e, gpus))?;
    dp.set_static_feeds(true)?;
    let step = |dp: &mut graphrun::DataParallel| {
        dp.train_step_shards(&shards)?;
        Ok(())
    };
    let (med, min, max, group) =
        time_steps(a.warmup.max(1), a.iters, &mut dp, step, |dp| Ok(dp.sync()?))?;
    let samples = (per_gpu * gpus) as f64 / (med * 1e-3);
    println!(
        "{}: {} on cuda × {} GPUs, train (data-parallel, batch {per_gpu} per GPU), {} iterations",
        model.graph.name,
        a.model.display(),
        gpus,
        a.iters
    );
    println!(
        "  median {med:.3} ms  min {min:.3} ms  max {max:.3} ms  ({group} step{} per timing sample)",
        if group > 1 { "s" } else { "" }
    );
    println!("  {samples:.1} samples/s");
    let state = dp.optimizer_state_bytes()?.into_iter().max().unwrap_or(0);
    println!(
        "  optimizer state per GPU: {:.1} MiB{}",
        state as f64 / (1u64 << 20) as f64,
        if a.shard_optimizer {
            format!(" (sharded over {gpus} GPUs)")
        } else {
            String::new()
        }
    );
    if let Some(p) = &a.json {
        let dtype = a.common.dtype.clone().unwrap_or_else(|| "f32".into());
        let json = format!(
            "{{\"results\": [{{\"workload\": {:?}, \"dtype\": \"{dtype}\", \"mode\": \"graphrun\", \"pass\": \"train\", \"backend\": \"cuda\", \"gpus\": {}, \"batch_per_gpu\": {per_gpu}, \"ms\": {med}, \"ms_min\": {min}, \"ms_max\": {max}, \"samples_per_s\": {samples}, \"sharded_optimizer\": {}, \"optimizer_state_bytes_per_gpu\": {state}, \"status\": \"ok\"}}]}}\n",
            model.graph.name, gpus, a.shard_optimizer
        );
        write_atomic(p, |w| w.write_all(json.as_bytes()))?;
    }
    Ok(())
}

/// Reads `flag`'s NAME=FILE.npy for a graph input that `given` says is not set yet:
/// (NAME, FILE, the input, the data). With --dtype (`cast_floats`) float files are cast
/// like the model's floats; the dtype must then be the input's.
/// Feeds from --input NAME=FILE.npy flags.
fn read_inputs(
    g: &graphrun::Graph,
    specs: &[String],
    cast_floats: bool,
) -> Result<HashMap<String, Tensor>, Fail> {
    let mut feeds = HashMap::new();
    for spec in specs {
        let (name, _, _, t) =
            read_input_npy(g, spec, "--input", cast_floats, |n| feeds.contains_key(n))?;
        feeds.insert(name, t);
    }
    Ok(feeds)
}

/// Inputs whose values decide shapes are planned for their values: random data would
/// decide the shapes, so each must be given.
fn need_plan_inputs(g: &graphrun::Graph, feeds: &HashMap<String, Tensor>) -> Result<(), Fail> {
    for p in graphrun::graph::infer::plan_time_inputs(g) {
        if !feeds.contains_key(&p.name) {
            return Err(usage(format!(
                "input '{}' decides {}: the plan is made for its value, so give it with --input {}=FILE.npy",
                p.name,
                exec::plan_input_use(g, &p),
                p.name
            )));
        }
    }
    Ok(())
}

/// `given`, and seeded random data for the other inputs (their symbolic dims bound by
/// `given`, then `dims`, then the model's defaults).
fn with_random_inputs(
    g: &graphrun::Graph,
    mut feeds: HashMap<String, Tensor>,
    dims: &BTreeMap<String, usize>,
    seed: u64,
) -> Result<HashMap<String, Tensor>, Error> {
    let bound = exec::bind_dims(g, &feeds, dims)?;
    for i in &g.inputs {
        if !feeds.contains_key(&i.name) {
            let shape = exec::concrete_shape(i, &bound)?;
            feeds.insert(i.name.clone(), exec::random_input(i, &shape, seed)?);
        }
    }
    Ok(feeds)
}

fn read_input_npy<'g>(
    g: &'g graphrun::Graph,
    spec: &str,
    flag: &str,
    cast_floats: bool,
    given: impl Fn(&str) -> bool,
) -> Result<(String, String, &'g graphrun::graph::InputInfo, Tensor), Fail> {
    let (name, file) = parse_kv(spec, flag)?;
    let Some(info) = g.input(&name) else {
        let names: Vec<&str> = g.inputs.iter().map(|i| i.name.as_str()).collect();
        return Err(usage(format!(
            "{flag} {name}: the model has no input '{name}' (its inputs: {})",
            names.join(", ")
        )));
    };
    if given(&name) {
        return Err(usage(format!("{flag} {name} is given twice")));
    }
    let mut t = Tensor::read_npy_as(Path::new(&file), &format!("{flag} {name}"))?;
    if t.dtype().is_float() && info.dtype.is_float() && t.dtype() != info.dtype && cast_floats {
        t = t.cast(info.dtype);
    }
    // The narrow types are written to .npy as bytes (`npy_descr`: the floats' bit
    // patterns as u8, the integers' values as u8 or i8), so such bytes read as them.
    if info.dtype.narrow_bits().is_some() && t.dtype().npy_descr() == info.dtype.npy_descr() {
        let range = info.dtype.int_range();
        if let Some(v) = t
            .to_i64_vec()
            .iter()
            .find(|&&v| range.is_some_and(|(lo, hi)| !(lo..=hi).contains(&(v as i128))))
        {
            return Err(usage(format!(
                "{flag} {name}={file}: the input is {}, which does not hold {v}",
                info.dtype
            )));
        }
        t = Tensor::from_bytes(info.dtype, t.shape(), t.bytes())?;
    }
    if t.dtype() != info.dtype {
        return Err(usage(format!(
            "{flag} {name}={file}: the file holds {} data, the input is {}",
            t.dtype(),
            info.dtype
        )));
    }
    Ok((name, file, info, t))
}

/// Reads NAME=FILE.npy data sets: every graph input, equal sample counts (axis 0).
fn read_data(
    specs: &[String],
    g: &graphrun::Graph,
    flag: &str,
    dtype: Option<&str>,
) -> Result<(Vec<(String, Tensor)>, usize), Fail> {
    let mut sets: Vec<(String, Tensor)> = vec![];
    for spec in specs {
        let (name, file, info, t) = read_input_npy(g, spec, flag, dtype.is_some(), |n| {
            sets.iter().any(|(s, _)| s == n)
        })?;
        if t.shape().len() != info.shape.len() || t.shape().is_empty() {
            return Err(usage(format!(
                "{flag} {name}={file}: shape {} does not match the input's rank {} (samples go along the first axis)",
                graphrun::tensor::fmt_shape(t.shape()),
                info.shape.len()
            )));
        }
        sets.push((name, t));
    }
    let missing: Vec<&str> = g
        .inputs
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| !sets.iter().any(|(m, _)| m == n))
        .collect();
    if !sets.is_empty() && !missing.is_empty() {
        return Err(usage(format!(
            "no {flag} for input{} {}",
            if missing.len() > 1 { "s" } else { "" },
            missing
                .iter()
                .map(|m| format!("'{m}'"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let n = sets.first().map(|(_, t)| t.shape()[0]).unwrap_or(0);
    if let Some((name, t)) = sets.iter().find(|(_, t)| t.shape()[0] != n) {
        return Err(usage(format!(
            "{flag} {name} holds {} samples, {} holds {n}: every data file needs the same count",
            t.shape()[0],
            sets[0].0
        )));
    }
    Ok((sets, n))
}

/// Rows `idx` (along axis 0) of `t`.
fn take_rows(t: &Tensor, idx: &[usize]) -> Result<Tensor, Fail> {
    Ok(t.take_rows(idx)?)
}

/// Mean loss, and accuracy when the loss is a SoftmaxCrossEntropyLoss, over a data set.
fn evaluate(
    session: &mut Trainer,
    sets: &[(String, Tensor)],
    n: usize,
    batch: usize,
) -> Result<(f64, Option<f64>), Fail> {
    let g = session.graph().clone();
    let t = g.training.as_ref().expect("checked");
    let sce = g.nodes.iter().find(|nd| {
        nd.outputs.first() == Some(&t.loss)
            && matches!(nd.op, graphrun::Op::SoftmaxCrossEntropyLoss { .. })
    });
    let mut fetch = vec![t.loss.clone()];
    if let Some(nd) = sce {
        fetch.push(nd.inputs[0].clone());
        fetch.push(nd.inputs[1].clone());
    }
    let ignore = sce.and_then(|nd| match nd.op {
        graphrun::Op::SoftmaxCrossEntropyLoss { ignore_index, .. } => ignore_index,
        _ => None,
    });
    let (mut loss_sum, mut batches, mut right, mut counted) = (0.0, 0usize, 0usize, 0usize);
    let idx: Vec<usize> = (0..n).collect();
    for chunk in idx.chunks(batch) {
        let feeds: HashMap<String, Tensor> = sets
            .iter()
            .map(|(name, t)| Ok((name.clone(), take_rows(t, chunk)?)))
            .collect::<Result<_, Fail>>()?;
        let vals = session.run_fetch(&feeds, &fetch)?;
        let l = vals[0].to_f64_vec();
        loss_sum += l.iter().sum::<f64>() / l.len().max(1) as f64;
        batches += 1;
        if vals.len() == 3 {
            // scores [N, C, d...], labels [N, d...]: argmax over the class axis.
            let (sc, lab) = (vals[1].to_f64_vec(), vals[2].to_i64_vec());
            let c = vals[1].shape()[1];
            let inner: usize = vals[1].shape()[2..].iter().product();
            for (k, &y) in lab.iter().enumerate() {
                if Some(y) == ignore {
                    continue;
                }
                let (b, i) = (k / inner.max(1), k % inner.max(1));
                let at = |j: usize| sc[(b * c + j) * inner + i];
                let best = (0..c).max_by(|&p, &q| at(p).total_cmp(&at(q))).unwrap_or(0);
                right += (best as i64 == y) as usize;
                counted += 1;
            }
        }
    }
    let acc = (counted > 0).then(|| right as f64 / counted as f64);
    Ok((loss_sum / batches.max(1) as f64, acc))
}

/// Makes `--loss OUTPUT` the graph's training loss (keeping its optimizer, else Adam), or
/// appends `--cross-entropy OUTPUT`'s loss and makes that the training loss.
fn with_loss(g: &mut graphrun::Graph, a: &TrainArgs) -> Result<(), Fail> {
    let appended;
    let loss = match (&a.loss, &a.cross_entropy) {
        (Some(l), _) => l,
        (None, Some(logits)) => {
            appended = graphrun::graph::loss::append_cross_entropy_on(
                g,
                logits,
                a.class_axis,
                "labels",
                &graphrun::backends::cpu::HOST_EVAL,
            )
            .map_err(|e| usage(format!("--cross-entropy {logits}: {e}")))?;
            &appended
        }
        (None, None) => return Ok(()),
    };
    if !g.outputs.contains(loss) {
        return Err(usage(format!(
            "--loss {loss}: the model's outputs are {}",
            g.outputs.join(", ")
        )));
    }
    let optimizer =
        g.training
            .take()
            .map(|t| t.optimizer)
            .unwrap_or(graphrun::graph::Optimizer::Adam {
                lr: 0.001,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            });
    g.training = Some(graphrun::graph::Training {
        loss: loss.clone(),
        optimizer,
    });
    Ok(())
}

fn train(a: TrainArgs) -> Result<(), Fail> {
    // An ONNX model trains as PyTorch's train() mode runs it (BatchNormalization on the
    // batch's statistics, its running statistics moved after each step) and is evaluated
    // on held-out data as eval() runs it, from a second import that takes the trained
    // values by name.
    let dtype = a.common.dtype.as_deref();
    use graphrun::onnx::{ImportMode, ImportOptions};
    let shapes = import_shapes(&a.common.dims, &a.data, a.batch_size);
    let import = |mode| ImportOptions {
        mode,
        ..shapes.clone()
    };
    let mut model = load_as(&a.model, dtype, &import(ImportMode::Train))?;
    check_outputs(a.plot.iter().chain(&a.save))?;
    with_loss(&mut model.graph, &a)?;
    let eval_graph = if model.graph.updates.is_empty() || a.val_data.is_empty() {
        None
    } else {
        let mut m = load_as(&a.model, dtype, &import(ImportMode::Eval))?;
        with_loss(&mut m.graph, &a)?;
        m.graph.training = model.graph.training.clone();
        Some(m.graph)
    };
    let Some(tr) = model.graph.training.as_mut() else {
        return Err(usage(format!(
            "{}: the model has no training: section (loss and optimizer) to train with; \
             --loss OUTPUT trains a scalar output with Adam, --cross-entropy OUTPUT its \
             logits against labels",
            a.model.display()
        )));
    };
    if let Some(lr) = a.lr {
        *tr.optimizer.lr_mut() = lr;
        if let Err((_, why)) = tr.optimizer.check() {
            return Err(usage(format!("--lr: {why}")));
        }
    }
    let g = model.graph.clone();
    let dims = parse_dims(&g, &a.common.dims)?;
    let (mut sets, mut n) = read_data(&a.data, &g, "--data", a.common.dtype.as_deref())?;
    let (val, nval) = read_data(&a.val_data, &g, "--val-data", a.common.dtype.as_deref())?;
    // The batch size: --batch-size, else the model's first input dim.
    let first = g.inputs.first().and_then(|i| i.shape.first());
    let model_batch = match first {
        Some(graphrun::graph::Dim::Fixed(b)) => Some(*b),
        Some(graphrun::graph::Dim::Sym(s)) => dims.get(s).or(g.dims.get(s)).copied(),
        None => None,
    };
    if sets.is_empty() {
        let feeds = model.random_inputs(a.seed, &dims)?;
        n = feeds
            .values()
            .next()
            .map(|t| t.shape().first().copied().unwrap_or(1))
            .unwrap_or(1);
        sets = g
            .inputs
            .iter()
            .map(|i| (i.name.clone(), feeds[&i.name].clone()))
            .collect();
        if !a.quiet {
            eprintln!(
                "no --data: training on one batch of seeded random inputs (seed {})",
                a.seed
            );
        }
    }
    let batch = a.batch_size.or(model_batch).unwrap_or(32).min(n.max(1));
    if batch == 0 || n == 0 {
        return Err(usage("the training data holds no samples"));
    }
    let per_epoch = n / batch;
    let total = match (a.steps, a.epochs) {
        (Some(s), _) => s,
        (None, e) => e.unwrap_or(1) * per_epoch,
    };
    if total == 0 {
        return Err(usage("nothing to train: --steps or --epochs is 0"));
    }
    let opts = SessionOptions {
        allow_nonfinite: a.allow_nonfinite,
        ..session_options(&a.common, dims, true)
    };
    let eval_opts = opts.clone();
    let (fused, _) = optimized(&g, a.common.no_fuse, &a.common.disable_pass, true)?;
    if a.gpus > 1 && batch % a.gpus != 0 {
        return Err(usage(format!(
            "--gpus {}: the batch of {batch} samples does not split evenly over {} GPUs \
             (choose --batch-size)",
            a.gpus, a.gpus
        )));
    }
    if a.gpus == 0 {
        return Err(usage("--gpus must be at least 1"));
    }
    if a.accumulate == 0 {
        return Err(usage("--accumulate must be at least 1"));
    }
    // Several processes (torchrun, srun, mpirun): this one trains its share of each batch.
    let launch = graphrun::exec::launch::Launch::from_env()?;
    let (procs, rank) = launch.as_ref().map_or((1, 0), |l| (l.world, l.rank));
    let lead = rank == 0;
    if batch % (procs * a.gpus) != 0 {
        return Err(usage(format!(
            "{procs} processes × {} GPUs: the batch of {batch} samples does not split evenly \
             over them (choose --batch-size)",
            a.gpus
        )));
    }
    if batch % (procs * a.gpus * a.accumulate) != 0 {
        return Err(usage(format!(
            "--accumulate {}: the batch of {batch} samples{} does not split into {} equal \
             micro-batches (choose --batch-size)",
            a.accumulate,
            if a.gpus > 1 {
                format!(" over {} GPUs", a.gpus)
            } else {
                String::new()
            },
            a.gpus * a.accumulate
        )));
    }
    let mut opts = opts;
    opts.shard_optimizer = a.shard_optimizer;
    if a.accumulate > 1 {
        // The batch symbols take the micro-batch's size, not a bound global batch.
        for i in &fused.inputs {
            if let Some(graphrun::graph::Dim::Sym(s)) = i.shape.first() {
                opts.dims.remove(s);
            }
        }
    }
    let mut session = if let Some(l) = &launch {
        let mut dp = graphrun::DataParallel::launched(fused, opts, a.gpus, l).map_err(|e| {
            let said = format!("data-parallel training on {} GPUs: ", a.gpus);
            reworded(e, |m| {
                format!(
                    "process {} of {} (the launcher's WORLD_SIZE): {}",
                    l.rank,
                    l.world,
                    m.strip_prefix(&said).unwrap_or(&m)
                )
            })
        })?;
        dp.set_accumulate(a.accumulate)?;
        Trainer::Many(dp)
    } else if a.gpus > 1 {
        let mut dp =
            graphrun::DataParallel::new(fused, opts, a.gpus).map_err(|e| flagged(e, a.gpus))?;
        dp.set_accumulate(a.accumulate)?;
        Trainer::Many(dp)
    } else {
        Trainer::One(Session::new(fused, opts)?, a.accumulate)
    };
    let on = match &launch {
        Some(l) => format!(
            "{} in each of {} processes",
            session.backend_name(),
            l.world
        ),
        None => session.backend_name(),
    };
    println!(
        "training {} on {on}: {n} samples, batch {batch}{}, {total} steps ({:.2} epochs), {}",
        g.name,
        if a.accumulate > 1 {
            format!(" in {} micro-batches", a.accumulate)
        } else {
            String::new()
        },
        total as f64 / per_epoch as f64,
        describe_optimizer(&g)
    );
    // Only the first process reports (the others' losses are their shares' alone).
    let bar = if a.quiet || !lead {
        indicatif::ProgressBar::hidden()
    } else {
        let b = indicatif::ProgressBar::new(total as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                // Fits 80 columns: the bar, steps, loss and rate (msg), time and ETA.
                "{bar:20} {pos}/{len} steps, loss {msg} [{elapsed} < {eta}]",
            )
            .expect("valid template"),
        );
        b
    };
    let stop = interrupt_flag();
    let t0 = std::time::Instant::now();
    let mut losses: Vec<f64> = vec![];
    let mut epoch_means: Vec<(usize, f64)> = vec![];
    let mut held_out: Vec<(usize, f64, Option<f64>)> = vec![];
    let mut rng = graphrun::rng::Rng::new(a.seed);
    let mut step = 0;
    let mut epoch = 0;
    while step < total {
        epoch += 1;
        // A seeded shuffle per epoch (Fisher–Yates).
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = rng.int_in(0, i as i64 + 1) as usize;
            order.swap(i, j);
        }
        let start = losses.len();
        let t_epoch = std::time::Instant::now();
        for chunk in order.chunks_exact(batch) {
            if step == total || stop.load(std::sync::atomic::Ordering::Relaxed) {
                break;
            }
            // This process's share of the batch (every process draws the same order).
            let per = batch / procs;
            let chunk = &chunk[rank * per..(rank + 1) * per];
            let feeds: HashMap<String, Tensor> = sets
                .iter()
                .map(|(name, t)| Ok((name.clone(), take_rows(t, chunk)?)))
                .collect::<Result<_, Fail>>()?;
            let l = session.train_step(&feeds)?;
            if !l.is_finite() && !a.allow_nonfinite {
                bar.abandon();
                return Err(Fail {
                    code: 1,
                    err: anyhow::anyhow!(
                        "the loss became {l} at step {}: lower the learning rate (--lr)",
                        step + 1
                    ),
                });
            }
            losses.push(l);
            step += 1;
            let rate = step as f64 / t0.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!("{l:.4}, {rate:.0} steps/s"));
            bar.inc(1);
        }
        let mean = losses[start..].iter().sum::<f64>() / (losses.len() - start).max(1) as f64;
        epoch_means.push((losses.len(), mean));
        let mut line = format!(
            "epoch {epoch}: loss {mean:.4} ({} in {:.1} s; {:.1} s in all)",
            counted(losses.len() - start, "step"),
            t_epoch.elapsed().as_secs_f64(),
            t0.elapsed().as_secs_f64()
        );
        if nval > 0 && lead {
            let (vl, acc) = match &eval_graph {
                None => evaluate(&mut session, &val, nval, batch)?,
                Some(g0) => {
                    let mut g = g0.clone();
                    let trained = session.trained_graph()?;
                    for i in &mut g.initializers {
                        if let Some(t) = trained.initializer(&i.name) {
                            i.tensor = t.tensor.clone();
                        }
                    }
                    let (fused, _) =
                        optimized(&g, a.common.no_fuse, &a.common.disable_pass, false)?;
                    let mut eval = Trainer::One(Session::new(fused, eval_opts.clone())?, 1);
                    evaluate(&mut eval, &val, nval, batch)?
                }
            };
            held_out.push((losses.len(), vl, acc));
            line.push_str(&format!(", held-out loss {vl:.4}"));
            if let Some(acc) = acc {
                line.push_str(&format!(", accuracy {:.2}%", acc * 100.0));
            }
        }
        if lead {
            bar.suspend(|| println!("{line}"));
        }
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
    }
    bar.finish_and_clear();
    let interrupted = stop.load(std::sync::atomic::Ordering::Relaxed);
    if interrupted {
        eprintln!("interrupted after {}", counted(step, "step"));
    }
    if losses.is_empty() {
        return Err(Fail {
            code: 130,
            err: anyhow::anyhow!("interrupted before the first step; nothing saved"),
        });
    }
    if !lead {
        // The first process saves and plots.
        session.finish();
        return Ok(());
    }
    println!(
        "trained {} in {:.2} s; loss {:.4} -> {:.4}",
        counted(losses.len(), "step"),
        t0.elapsed().as_secs_f64(),
        losses[0],
        losses[losses.len() - 1]
    );
    // The plot and the checkpoint together or neither.
    let mut out = files::Outputs::new();
    let mut wrote = vec![];
    if let Some(p) = &a.plot {
        let curves = Curves {
            name: &g.name,
            losses: &losses,
            epochs: &epoch_means,
            held_out: &held_out,
        };
        let svg = train_plot(&curves, a.plot_log).map_err(|m| Fail {
            code: 1,
            err: anyhow::anyhow!("--plot {}: {m}", p.display()),
        })?;
        out.stage(p, |w| w.write_all(svg.as_bytes()))?;
        wrote.push(format!("wrote {}", p.display()));
    }
    if let Some(p) = &a.save {
        let trained = session.trained_graph()?;
        if !a.allow_nonfinite {
            // The step checks see every update whose loss was read; this sees the rest.
            let bad = trained
                .initializers
                .iter()
                .find(|i| i.trainable && i.tensor.to_f64_vec().iter().any(|v| !v.is_finite()));
            if let Some(i) = bad {
                return Err(Fail {
                    code: 1,
                    err: anyhow::anyhow!(
                        "not saving {}: parameter '{}' holds NaN or infinite values (--allow-nonfinite saves it anyway)",
                        p.display(),
                        i.name
                    ),
                });
            }
        }
        // The model's own initializers (not the constants the passes made).
        let tensors: Vec<(String, &Tensor)> = trained
            .initializers
            .iter()
            .filter(|i| g.initializer(&i.name).is_some())
            .map(|i| (i.name.clone(), &i.tensor))
            .collect();
        out.stage(p, |w| Tensor::write_safetensors_to(&tensors, w))?;
        wrote.push(format!(
            "wrote {} ({} initializers)",
            p.display(),
            tensors.len()
        ));
    }
    out.commit()?;
    session.finish();
    for w in wrote {
        println!("{w}");
    }
    if interrupted {
        return Err(Fail {
            code: 130,
            err: anyhow::anyhow!("training was interrupted (Ctrl-C); what was saved is complete"),
        });
    }
    Ok(())
}

/// What `train` trains with: one session, or one per GPU (`--gpus`).
// Without the cuda feature, DataParallel is an empty stand-in and the variants differ in
// size; there is one Trainer per run, so the difference costs nothing.
#[cfg_attr(not(feature = "cuda"), allow(clippy::large_enum_variant))]
enum Trainer {
    /// One session, and the micro-batches of a step (`--accumulate`).
    One(Session, usize),
    Many(graphrun::DataParallel),
}

impl Trainer {
    fn train_step(&mut self, feeds: &HashMap<String, Tensor>) -> graphrun::Result<f64> {
        match self {
            Trainer::One(s, 1) => s.train_step(feeds),
            Trainer::One(s, k) => {
                s.train_step_accumulated(&graphrun::exec::split_feeds(feeds, *k, "micro-batches")?)
            }
            Trainer::Many(d) => d.train_step(feeds),
        }
    }
    fn run_fetch(
        &mut self,
        feeds: &HashMap<String, Tensor>,
        fetch: &[String],
    ) -> graphrun::Result<Vec<Tensor>> {
        match self {
            Trainer::One(s, _) => s.run_fetch(feeds, fetch),
            Trainer::Many(d) => d.run_fetch(feeds, fetch),
        }
    }
    fn graph(&self) -> &graphrun::Graph {
        match self {
            Trainer::One(s, _) => s.graph(),
            Trainer::Many(d) => d.graph(),
        }
    }
    fn trained_graph(&mut self) -> graphrun::Result<graphrun::Graph> {
        match self {
            Trainer::One(s, _) => s.trained_graph().cloned(),
            Trainer::Many(d) => d.trained_graph(),
        }
    }
    /// The end of a run that went well (`DataParallel::finish`).
    fn finish(&mut self) {
        if let Trainer::Many(d) = self {
            d.finish();
        }
    }
    fn backend_name(&self) -> String {
        match self {
            Trainer::One(s, _) => s.backend_name().to_string(),
            Trainer::Many(d) => format!("cuda × {} GPUs", d.gpus()),
        }
    }
}

/// A flag that the first Ctrl-C sets (training then stops after the current step and
/// saves a complete checkpoint); a second Ctrl-C ends the process at once. Files are
/// only ever written whole (`write_atomic`), so neither leaves a half-written one.
fn interrupt_flag() -> &'static std::sync::atomic::AtomicBool {
    static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    #[cfg(unix)]
    {
        extern "C" fn on_sigint(_: libc::c_int) {
            STOP.store(true, std::sync::atomic::Ordering::Relaxed);
            // The next Ctrl-C gets the default behaviour.
            unsafe {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
            }
        }
        unsafe {
            libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
        }
    }
    &STOP
}

fn describe_optimizer(g: &graphrun::Graph) -> String {
    use graphrun::graph::Optimizer as O;
    match g.training.as_ref().map(|t| &t.optimizer) {
        Some(O::Sgd {
            lr,
            momentum,
            weight_decay,
        }) => {
            format!("SGD lr {lr} momentum {momentum} weight decay {weight_decay}")
        }
        Some(O::Adam {
            lr,
            beta1,
            beta2,
            weight_decay,
            ..
        }) => {
            format!("Adam lr {lr} betas ({beta1}, {beta2}) weight decay {weight_decay}")
        }
        Some(O::AdamW {
            lr,
            beta1,
            beta2,
            weight_decay,
            ..
        }) => {
            format!("AdamW lr {lr} betas ({beta1}, {beta2}) weight decay {weight_decay}")
        }
        None => "no optimizer".into(),
    }
}

/// What `train --plot` draws: the loss of every step, the mean of each epoch (`epochs`
/// holds the step that ended it), and per epoch the held-out loss and accuracy when --val-data is given.
struct Curves<'a> {
    name: &'a str,
    losses: &'a [f64],
    epochs: &'a [(usize, f64)],
    /// (steps so far, held-out loss, held-out accuracy).
    held_out: &'a [(usize, f64, Option<f64>)],
}

const STEP_COLOR: plotters::style::RGBColor = plotters::style::RGBColor(31, 119, 180);
const EPOCH_COLOR: plotters::style::RGBColor = plotters::style::RGBColor(214, 39, 40);
const HELD_OUT_COLOR: plotters::style::RGBColor = plotters::style::RGBColor(44, 160, 44);
const ACCURACY_COLOR: plotters::style::RGBColor = plotters::style::RGBColor(148, 103, 189);

/// The bias-corrected exponential moving average of `xs` (as TensorBoard smooths): each
/// point weighs the last ~`span` steps, and the first points are not pulled towards 0.
fn ema(xs: &[f64], span: usize) -> Vec<f64> {
    let beta = 1.0 - 1.0 / span.max(1) as f64;
    let (mut m, mut w) = (0.0, 0.0);
    xs.iter()
        .map(|&x| {
            m = beta * m + (1.0 - beta) * x;
            w = beta * w + (1.0 - beta);
            m / w
        })
        .collect()
}

/// The training curves as an SVG document (`--plot`), the loss axis logarithmic with
/// `log` (where only positive losses can be drawn). With held-out accuracy, a second
/// panel under the losses shows it against the same steps.
fn train_plot(c: &Curves, log: bool) -> Result<String, String> {
    use plotters::prelude::*;
    let accuracy: Vec<(f64, f64)> = c
        .held_out
        .iter()
        .filter_map(|&(s, _, a)| a.map(|a| (s as f64, 100.0 * a)))
        .collect();
    let mut svg = String::new();
    {
        let height = if accuracy.is_empty() { 540 } else { 760 };
        let root = SVGBackend::with_string(&mut svg, (960, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let title = format!(
            "{}: training{}",
            c.name,
            if log { " (loss on a log scale)" } else { "" }
        );
        let root = root
            .titled(&title, ("sans-serif", 22))
            .map_err(|e| e.to_string())?;
        let (top, bottom) = if accuracy.is_empty() {
            (root, None)
        } else {
            let (t, b) = root.split_vertically(height - 40 - 230);
            (t, Some(b))
        };
        let keep = |v: &f64| v.is_finite() && (!log || *v > 0.0);
        let all = c
            .losses
            .iter()
            .chain(c.epochs.iter().map(|e| &e.1))
            .chain(c.held_out.iter().map(|h| &h.1))
            .copied()
            .filter(keep);
        let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(v), h.max(v))
        });
        if lo > hi {
            return Err(if log {
                "no positive loss to draw on a log scale (drop --plot-log)".into()
            } else {
                "no finite loss to draw".into()
            });
        }
        if log {
            let (lo, hi) = if hi > lo {
                (lo, hi)
            } else {
                (lo / 2.0, hi * 2.0)
            };
            draw_losses(&top, c, (lo / 1.25..hi * 1.25).log_scale(), log)?;
        } else {
            let pad = if hi > lo { 0.05 * (hi - lo) } else { 0.5 };
            // Losses are usually non-negative: then the axis starts at 0.
            let floor = if lo >= 0.0 { 0.0 } else { lo - pad };
            draw_losses(&top, c, floor..hi + pad, log)?;
        }
        if let Some(area) = bottom {
            draw_accuracy(&area, c.losses.len(), accuracy)?;
        }
        top.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

type SvgArea<'a> =
    plotters::drawing::DrawingArea<plotters::backend::SVGBackend<'a>, plotters::coord::Shift>;

/// A tick label with at most three significant digits (a log axis's ticks are products
/// of floats, e.g. 0.6000000000000001).
fn tick(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// The x axis of both panels: steps, counted from 1 (step k's loss is drawn at x = k).
fn step_range(steps: usize) -> std::ops::Range<f64> {
    0f64..(steps.max(2) as f64)
}

fn draw_losses<Y>(area: &SvgArea, c: &Curves, y: Y, log: bool) -> Result<(), String>
where
    Y: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    Y::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
{
    use plotters::prelude::*;
    let e = |e: DrawingAreaErrorKind<_>| e.to_string();
    let n = c.losses.len();
    let keep = |v: f64| v.is_finite() && (!log || v > 0.0);
    let mut chart = ChartBuilder::on(area)
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(step_range(n), y)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(if log { "loss (log scale)" } else { "loss" })
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 13))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| tick(*v))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .draw()
        .map_err(e)?;
    let per_step = c
        .losses
        .iter()
        .enumerate()
        .map(|(i, &v)| ((i + 1) as f64, v))
        .filter(|p| keep(p.1));
    let faint = STEP_COLOR.mix(0.3);
    chart
        .draw_series(LineSeries::new(per_step, faint))
        .map_err(e)?
        .label("training loss, per step")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], faint));
    let span = (n / 40).clamp(1, 200);
    if n > 2 && span > 1 {
        let smooth = ema(c.losses, span)
            .into_iter()
            .enumerate()
            .map(|(i, v)| ((i + 1) as f64, v))
            .filter(|p| keep(p.1));
        chart
            .draw_series(LineSeries::new(smooth, STEP_COLOR.stroke_width(2)))
            .map_err(e)?
            .label(format!("training loss, moving average (~{span} steps)"))
            .legend(|(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], STEP_COLOR.stroke_width(2))
            });
    }
    // An epoch's mean is over all its steps: drawn at its middle step. Where every epoch
    // is one step (a single batch of data) the means are the per-step curve again.
    let epochs: Vec<(f64, f64)> = c
        .epochs
        .iter()
        .filter(|_| c.epochs.len() < n)
        .scan(0, |start, &(end, v)| {
            let mid = (*start + 1 + end) as f64 / 2.0;
            *start = end;
            Some((mid, v))
        })
        .filter(|p| keep(p.1))
        .collect();
    let held: Vec<(f64, f64)> = c
        .held_out
        .iter()
        .map(|&(s, v, _)| (s as f64, v))
        .filter(|p| keep(p.1))
        .collect();
    for (pts, color, label) in [
        (epochs, EPOCH_COLOR, "training loss, epoch mean"),
        (held, HELD_OUT_COLOR, "held-out loss, after each epoch"),
    ] {
        if pts.is_empty() {
            continue;
        }
        let dots = pts.iter().map(|&p| Circle::new(p, 4, color.filled()));
        chart.draw_series(dots).map_err(e)?;
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(e)?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        // Losses start high on the left and fall: the upper right is where the legend
        // hides the least.
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(e)?;
    Ok(())
}

/// The held-out accuracy panel: percent after each epoch, on the loss panel's steps.
fn draw_accuracy(area: &SvgArea, steps: usize, pts: Vec<(f64, f64)>) -> Result<(), String> {
    use plotters::prelude::*;
    let e = |e: DrawingAreaErrorKind<_>| e.to_string();
    let lo = pts.iter().map(|p| p.1).fold(100.0, f64::min);
    // From a round 10 below the worst epoch, so that late gains stay visible.
    let floor = ((lo - 5.0) / 10.0).floor().clamp(0.0, 9.0) * 10.0;
    let mut chart = ChartBuilder::on(area)
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(step_range(steps), floor..100f64)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("held-out accuracy (%)")
        .axis_desc_style(("sans-serif", 16))
        .label_style(("sans-serif", 13))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| tick(*v))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .draw()
        .map_err(e)?;
    let dots = pts
        .iter()
        .map(|&p| Circle::new(p, 4, ACCURACY_COLOR.filled()));
    chart.draw_series(dots).map_err(e)?;
    chart
        .draw_series(LineSeries::new(pts, ACCURACY_COLOR.stroke_width(2)))
        .map_err(e)?
        .label("held-out accuracy, after each epoch")
        .legend(|(x, y)| {
            PathElement::new(vec![(x, y), (x + 20, y)], ACCURACY_COLOR.stroke_width(2))
        });
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(e)?;
    Ok(())
}

/// "1 step", "3 steps".
fn counted(n: usize, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

/// A library error from `DataParallel::new`, prefixed with the flag that asked for it.
fn flagged(e: Error, gpus: usize) -> Error {
    let said = format!("data-parallel training on {gpus} GPUs: ");
    reworded(e, |m| {
        format!("--gpus {gpus}: {}", m.strip_prefix(&said).unwrap_or(&m))
    })
}

/// The error with its message rewritten by `f`, of the same kind (and so exit code).
fn reworded(e: Error, f: impl Fn(String) -> String) -> Error {
    match e {
        Error::Input(m) => Error::Input(f(m)),
        Error::Runtime(m) => Error::Runtime(f(m)),
        Error::Graph(m) => Error::Graph(f(m)),
        other => other,
    }
}
