//! The `graphrun` command line (SPEC §5): argument parsing and printing on top of the
//! library. Exit codes: 0 success, 2 bad model or arguments, 1 failure while running.

use clap::{Args, Parser, Subcommand};
use graphrun::error::Error;
use graphrun::exec::{self, write_atomic};
use graphrun::graph::infer::ValueType;
use graphrun::passes;
use graphrun::{BackendKind, DType, Model, Session, SessionOptions, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "graphrun",
    version,
    about = "Run, inspect and train ONNX-style YAML models on CPU, CUDA or WebGPU",
    after_help = "`graphrun MODEL.yaml [options]` is short for `graphrun run MODEL.yaml [options]`."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a model and print (or save) its outputs.
    Run(RunArgs),
    /// Print the graph before and after the passes, its FLOPs and planned memory.
    Inspect(InspectArgs),
    /// Report what this machine offers: CPU threads, CUDA, WebGPU adapters.
    Doctor,
    /// Time a model: median/min/max per iteration, throughput, memory, per-node profile.
    Bench(BenchArgs),
    /// Train a model's trainable initializers on data.
    Train(TrainArgs),
}

#[derive(Args, Clone)]
struct Common {
    /// Backend to run on.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    backend: String,
    /// Bind a symbolic dim: SYM=N.
    #[arg(long = "dim", value_name = "SYM=N")]
    dims: Vec<String>,
    /// Cast floating inputs and initializers to this dtype before running.
    #[arg(long, value_parser = ["f32", "f16", "bf16"])]
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
    /// Also run the backward graph (gradients of every output).
    #[arg(long)]
    backward: bool,
    /// Seed gradient for an output: NAME=FILE.npy (default all ones).
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
    model: PathBuf,
    #[arg(long)]
    no_fuse: bool,
    /// Switch one pass off by name (repeatable).
    #[arg(long = "disable-pass", value_name = "PASS")]
    disable_pass: Vec<String>,
    #[arg(long)]
    backward: bool,
    /// Bind a symbolic dim: SYM=N.
    #[arg(long = "dim", value_name = "SYM=N")]
    dims: Vec<String>,
    /// Write the graph (after passes) as Graphviz DOT.
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
    model: PathBuf,
    #[command(flatten)]
    common: Common,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long)]
    backward: bool,
    /// Write the results as JSON (the fields of ../shared/bench/torch_reference.py).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
struct TrainArgs {
    model: PathBuf,
    #[command(flatten)]
    common: Common,
    #[arg(long = "data", value_name = "NAME=FILE.npy")]
    data: Vec<String>,
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    epochs: Option<usize>,
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long, value_name = "FILE.safetensors")]
    save: Option<PathBuf>,
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
    // `graphrun MODEL ...` means `graphrun run MODEL ...`.
    let subcommands = ["run", "inspect", "doctor", "bench", "train", "help"];
    if argv.len() > 1 && !subcommands.contains(&argv[1].as_str()) && !argv[1].starts_with('-') {
        argv.insert(1, "run".into());
    }
    let cli = match Cli::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let r = match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::Inspect(a) => inspect(a),
        Cmd::Doctor => doctor(),
        Cmd::Bench(a) => bench(a),
        Cmd::Train(a) => train(a),
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

fn parse_dims(dims: &[String]) -> Result<BTreeMap<String, usize>, Fail> {
    let mut out = BTreeMap::new();
    for d in dims {
        let (k, v) = parse_kv(d, "--dim")?;
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

/// Loads the model and applies `--dtype`.
fn load(path: &Path, dtype: Option<&str>) -> Result<Model, Fail> {
    let mut m = Model::load(path)?;
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
) -> Result<(graphrun::Graph, Option<passes::Report>), Fail> {
    if no_fuse {
        return Ok((g.clone(), None));
    }
    let opts = passes::PassOptions {
        disabled: disabled.to_vec(),
        training: false,
    };
    let (g2, report) = passes::optimize(g, &opts)?;
    Ok((g2, Some(report)))
}

fn check_unimplemented(backward: bool) -> Result<(), Fail> {
    if backward {
        return Err(usage("--backward needs the backward-graph generator, which is not in this build of graphrun yet"));
    }
    Ok(())
}

fn run(a: RunArgs) -> Result<(), Fail> {
    check_unimplemented(a.backward || !a.grads.is_empty())?;
    if a.verify_fusion && a.common.no_fuse {
        return Err(usage(
            "--verify-fusion compares fused with unfused: drop --no-fuse",
        ));
    }
    let model = load(&a.model, a.common.dtype.as_deref())?;
    let g = &model.graph;
    let dims = parse_dims(&a.common.dims)?;
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
    // The backend is set up first, so that a missing device is the one line printed.
    let opts = SessionOptions {
        backend: backend_of(&a.common),
        dims: dims.clone(),
        training: false,
    };
    let (fused, _) = optimized(g, a.common.no_fuse, &a.common.disable_pass)?;
    let mut session = Session::new(fused, opts.clone())?;
    let mut feeds: HashMap<String, Tensor> = HashMap::new();
    for spec in &a.inputs {
        let (name, file) = parse_kv(spec, "--input")?;
        let Some(info) = g.input(&name) else {
            let names: Vec<&str> = g.inputs.iter().map(|i| i.name.as_str()).collect();
            return Err(usage(format!(
                "--input {name}: the model has no input '{name}' (its inputs: {})",
                names.join(", ")
            )));
        };
        if feeds.contains_key(&name) {
            return Err(usage(format!("--input {name} is given twice")));
        }
        let mut t = Tensor::read_npy(Path::new(&file))?;
        // With --dtype, float files are cast like the model's floats.
        if t.dtype().is_float()
            && info.dtype.is_float()
            && t.dtype() != info.dtype
            && a.common.dtype.is_some()
        {
            t = t.cast(info.dtype);
        }
        if t.dtype() != info.dtype {
            return Err(usage(format!(
                "--input {name}={file}: the file holds {} data, the input is {}",
                t.dtype(),
                info.dtype
            )));
        }
        feeds.insert(name, t);
    }
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
    let outs = session.run(&feeds)?;
    if a.verify_fusion {
        verify_fusion(g, opts, &feeds, &outs)?;
    }
    for (name, t) in &outs {
        if a.quiet {
            println!(
                "{name}: {} {}",
                t.dtype(),
                graphrun::tensor::fmt_shape(t.shape())
            );
        } else {
            println!(
                "{name}: {} {} {}",
                t.dtype(),
                graphrun::tensor::fmt_shape(t.shape()),
                t.summary()
            );
        }
    }
    if let Some(dir) = &a.out_dir {
        write_outputs(dir, &outs)?;
    }
    Ok(())
}

/// Runs the unfused graph on the same inputs and compares every output (SPEC §5).
fn verify_fusion(
    g: &graphrun::Graph,
    opts: SessionOptions,
    feeds: &HashMap<String, Tensor>,
    fused: &[(String, Tensor)],
) -> Result<(), Fail> {
    let plain = Session::new(g.clone(), opts)?.run(feeds)?;
    let mut worst = vec![];
    for ((name, a), (_, b)) in fused.iter().zip(&plain) {
        let (x, y) = (a.to_f64_vec(), b.to_f64_vec());
        let num: f64 = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (p - q) * (p - q))
            .sum::<f64>()
            .sqrt();
        let den: f64 = y.iter().map(|q| q * q).sum::<f64>().sqrt();
        let rel = if den > 0.0 { num / den } else { num };
        let tol = match a.dtype() {
            DType::F64 => 1e-10,
            DType::F32 => 1e-5,
            _ => 1e-2,
        };
        let ok = rel <= tol; // NaN fails
        println!(
            "verify-fusion {name}: max relative difference {rel:.3e} (tolerance {tol:.0e}) {}",
            if ok { "ok" } else { "FAILED" }
        );
        if !ok {
            worst.push(name.clone());
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

/// Writes DIR/<name>.npy for each output, each whole or not at all; on a failure the
/// files already written by this call are removed again.
fn write_outputs(dir: &Path, outs: &[(String, Tensor)]) -> Result<(), Fail> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut written = vec![];
    for (name, t) in outs {
        let path = dir.join(format!("{name}.npy"));
        if let Err(e) = write_atomic(&path, |p| t.write_npy(p)) {
            for w in &written {
                let _ = std::fs::remove_file(w);
            }
            return Err(Fail {
                code: 1,
                err: e.into(),
            });
        }
        written.push(path);
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
    check_unimplemented(a.backward)?;
    let model = load(&a.model, None)?;
    let g = &model.graph;
    let dims = parse_dims(&a.dims)?;
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
    let (fused, report) = optimized(g, a.no_fuse, &a.disable_pass)?;
    match &report {
        None => println!("passes: off (--no-fuse)"),
        Some(r) => {
            println!("passes:");
            for line in r.to_string().lines() {
                println!("  {line}");
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
    let model = Model {
        graph: fused.clone(),
    };
    // Plan with bound dims: --dim, then the model's defaults.
    let mut bound = g.dims.clone();
    bound.extend(dims.clone());
    let unbound: Vec<String> = g
        .symbols()
        .into_iter()
        .filter(|s| !bound.contains_key(s))
        .collect();
    if !unbound.is_empty() {
        return Err(usage(format!(
            "symbolic dim{} {} not bound: give --dim {}=N (or a default under dims:) to plan the model",
            if unbound.len() > 1 { "s" } else { "" },
            unbound.iter().map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", "),
            unbound[0]
        )));
    }
    let shapes: HashMap<String, Vec<usize>> = g
        .inputs
        .iter()
        .map(|i| Ok((i.name.clone(), exec::concrete_shape(i, &bound)?)))
        .collect::<Result<_, Error>>()?;
    let plan = graphrun::Plan::new(g, &shapes)?;
    let bind: Vec<String> = bound.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!(
        "plan ({}): {} steps, {}FLOP per run",
        if bind.is_empty() {
            "static shapes".into()
        } else {
            bind.join(", ")
        },
        plan.steps.len(),
        fmt_count(plan.flops as f64)
    );
    println!(
        "  peak activation memory {} (without buffer reuse: {}), weights {}",
        fmt_bytes(plan.peak_bytes()),
        fmt_bytes(plan.naive_bytes),
        fmt_bytes(plan.weight_bytes)
    );
    for o in &g.outputs {
        let t: &ValueType = &plan.types[o];
        println!("  {o}: {t}");
    }
    if let Some(p) = &a.dot {
        let text = graphrun::graph::dot::to_dot(g);
        write_atomic(p, |p| std::fs::write(p, &text).map_err(|e| Error::io(p, e)))?;
        println!("wrote {}", p.display());
    }
    if let Some(p) = &a.emit_yaml {
        model.save(p)?;
        println!("wrote {}", p.display());
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
    println!("cuda: not built into this version of graphrun");
    println!("wgpu: not built into this version of graphrun");
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
    check_unimplemented(a.backward)?;
    if a.iters == 0 {
        return Err(usage("--iters must be at least 1"));
    }
    let model = load(&a.model, a.common.dtype.as_deref())?;
    let dims = parse_dims(&a.common.dims)?;
    let feeds = model.random_inputs(a.seed, &dims)?;
    let opts = SessionOptions {
        backend: backend_of(&a.common),
        dims,
        training: false,
    };
    let (fused, _) = optimized(&model.graph, a.common.no_fuse, &a.common.disable_pass)?;
    let mut session = Session::new(fused, opts)?;
    let plan = session.plan_for(&feeds)?;
    for _ in 0..a.warmup {
        session.run(&feeds)?;
    }
    let mut times = vec![];
    for _ in 0..a.iters {
        let t0 = std::time::Instant::now();
        session.run(&feeds)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|x, y| x.total_cmp(y));
    let med = times[times.len() / 2];
    let (min, max) = (times[0], times[times.len() - 1]);
    let tflops = plan.flops as f64 / (med * 1e-3) / 1e12;
    let peak_mib = (plan.peak_bytes() + plan.weight_bytes) as f64 / (1024.0 * 1024.0);
    println!(
        "{}: {} on {}, {} iterations",
        model.graph.name,
        a.model.display(),
        session.backend_name(),
        a.iters
    );
    println!("  median {med:.3} ms  min {min:.3} ms  max {max:.3} ms");
    println!(
        "  {:.3} TFLOP/s ({}FLOP per iteration)",
        tflops,
        fmt_count(plan.flops as f64)
    );
    println!("  peak memory {peak_mib:.1} MiB (planned activations + weights)");
    // The per-node profile: one more set of runs, each node synchronized and timed.
    session.set_profiling(true);
    let prof_iters = a.iters.min(5);
    for _ in 0..prof_iters {
        session.run(&feeds)?;
    }
    let mut prof = session.take_profile();
    let total: f64 = prof.iter().map(|p| p.2).sum::<f64>().max(1e-12);
    prof.sort_by(|x, y| y.2.total_cmp(&x.2));
    println!(
        "  {:<28} {:<24} {:>10} {:>7}",
        "node", "op", "ms/iter", "share"
    );
    for (name, op, secs) in &prof {
        println!(
            "  {:<28} {:<24} {:>10.4} {:>6.1}%",
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
            "{{\"results\": [{{\"workload\": {:?}, \"dtype\": \"{}\", \"mode\": \"graphrun\", \"pass\": \"fwd\", \"backend\": \"{}\", \"ms\": {med}, \"ms_min\": {min}, \"ms_max\": {max}, \"tflops\": {tflops}, \"peak_mib\": {peak_mib}, \"status\": \"ok\", \"profile\": [{}]}}]}}\n",
            model.graph.name,
            dtype,
            session.backend_name(),
            nodes.join(", ")
        );
        write_atomic(p, |p| std::fs::write(p, &json).map_err(|e| Error::io(p, e)))?;
    }
    Ok(())
}

fn train(a: TrainArgs) -> Result<(), Fail> {
    let _ = (
        &a.model,
        &a.common,
        &a.data,
        a.batch_size,
        a.epochs,
        a.steps,
        &a.save,
    );
    Err(usage("`graphrun train` needs the backward-graph generator, which is not in this build of graphrun yet"))
}
