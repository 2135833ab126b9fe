//! Data-parallel training (`DataParallel`, `train --gpus`): a run on N GPUs gives the
//! losses and parameters of one GPU on the same global batch; bad requests and a failing
//! worker end in one clear error, never a hang.
//!
//! The GPU tests need CUDA and NCCL (they skip with the reason where either is missing,
//! and fail instead under GRAPHRUN_REQUIRE_CUDA); the two-GPU ones need two devices and
//! fail instead of skipping under GRAPHRUN_REQUIRE_GPUS=2.

// It calls the cuda backend's own functions, which a build without the `cuda` feature
// does not have.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use graphrun::exec::parallel::split_batch;
use graphrun::graph::Optimizer;
use graphrun::passes::PassOptions;
use graphrun::{BackendKind, DataParallel, Model, Session, SessionOptions, Tensor};
use std::collections::{BTreeMap, HashMap};

fn dims(v: &[(&str, usize)]) -> BTreeMap<String, usize> {
    v.iter().map(|(k, n)| (k.to_string(), *n)).collect()
}

/// How many GPUs the data-parallel tests may use here, or `None` (with the reason
/// printed) where they cannot run.
fn gpus(need: usize) -> Option<usize> {
    if !cuda_present() {
        return None;
    }
    if let Err(e) = graphrun::backends::cuda::nccl::nccl() {
        if std::env::var_os("GRAPHRUN_REQUIRE_CUDA").is_some() {
            panic!("GRAPHRUN_REQUIRE_CUDA is set but {e}");
        }
        eprintln!("skipping data-parallel: {e}");
        return None;
    }
    let have = graphrun::backends::cuda::device_count();
    let required: usize = std::env::var("GRAPHRUN_REQUIRE_GPUS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if have < need {
        assert!(
            required < need,
            "GRAPHRUN_REQUIRE_GPUS={required} but this machine has {have} CUDA devices"
        );
        eprintln!("skipping: needs {need} GPUs, this machine has {have}");
        return None;
    }
    Some(have)
}

fn cuda_opts(d: BTreeMap<String, usize>) -> SessionOptions {
    SessionOptions {
        backend: BackendKind::Cuda,
        dims: d,
        training: true,
        ..SessionOptions::unfused()
    }
}

/// A model fused for training and a seeded global batch.
fn setup(
    path: &str,
    d: &BTreeMap<String, usize>,
    seed: u64,
) -> (graphrun::Graph, HashMap<String, Tensor>) {
    let model = Model::load(path).unwrap();
    let feeds = model.random_inputs(seed, d).unwrap();
    let passes = PassOptions {
        training: true,
        ..Default::default()
    };
    let (fused, _) = graphrun::passes::optimize(&model.graph, &passes).unwrap();
    (fused, feeds)
}

/// Largest relative difference between two tensors' values.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    rel_err(&a.to_f64_vec(), &b.to_f64_vec())
}

/// Trains `steps` steps on one GPU and on `n` GPUs (same global batch each step) and
/// compares losses and the trained parameters.
fn one_vs_many(path: &str, d: BTreeMap<String, usize>, n: usize, steps: usize, tol: f64) {
    one_vs_many_with(path, d, n, Variant::default(), steps, tol)
}

/// How the data-parallel run differs from a plain one.
#[derive(Default, Clone)]
struct Variant {
    /// Micro-batches per GPU (gradient accumulation); 0 is 1.
    accumulate: usize,
    /// `SessionOptions::shard_optimizer`.
    shard: bool,
    /// In place of the model's optimizer.
    optimizer: Option<Optimizer>,
}

/// `one_vs_many` with each GPU's shard run as `k` micro-batches (gradient accumulation).
fn one_vs_many_accumulating(
    path: &str,
    d: BTreeMap<String, usize>,
    n: usize,
    k: usize,
    steps: usize,
    tol: f64,
) {
    let v = Variant {
        accumulate: k,
        ..Default::default()
    };
    one_vs_many_with(path, d, n, v, steps, tol)
}

fn one_vs_many_with(
    path: &str,
    d: BTreeMap<String, usize>,
    n: usize,
    v: Variant,
    steps: usize,
    tol: f64,
) {
    // Several small buckets, so that averages overlap the backward pass and their
    // ordering after each gradient's last reader is exercised.
    graphrun::set_tuning(graphrun::Tuning {
        dp_bucket_bytes: 65536,
        ..graphrun::tuning()
    });
    let (mut g, feeds) = setup(path, &d, 7);
    if let Some(o) = &v.optimizer {
        g.training.as_mut().unwrap().optimizer = o.clone();
    }
    let mut one = Session::new(g.clone(), cuda_opts(d.clone())).unwrap();
    let opts = SessionOptions {
        shard_optimizer: v.shard,
        ..cuda_opts(d)
    };
    let mut dp = DataParallel::new(g, opts, n).unwrap();
    assert_eq!(dp.gpus(), n);
    dp.set_accumulate(v.accumulate.max(1)).unwrap();
    for step in 0..steps {
        let a = one.train_step(&feeds).unwrap();
        let b = dp.train_step(&feeds).unwrap();
        assert!(
            (a - b).abs() <= tol * a.abs().max(1e-3),
            "{path}: step {step}: one GPU loss {a}, {n} GPUs {b}"
        );
    }
    assert_eq!(dp.steps(), steps as u64);
    // Each GPU's optimizer state: everything, or with sharding its shards only.
    let whole = one.optimizer_state_bytes();
    let per_gpu = dp.optimizer_state_bytes().unwrap();
    assert_eq!(per_gpu.len(), n);
    if v.shard {
        assert_eq!(
            per_gpu.iter().sum::<usize>(),
            whole,
            "{path}: shards {per_gpu:?}"
        );
        // Shards are cut in blocks of 64 elements (a small tensor's falls to one GPU):
        // each GPU's share is within a block per parameter (two f32 moments) of 1/n.
        let slack = one.graph().initializers.len() * 64 * 8;
        for &b in &per_gpu {
            assert!(b <= whole / n + slack, "{path}: {per_gpu:?} of {whole}");
        }
    } else {
        assert!(
            per_gpu.iter().all(|&b| b == whole),
            "{path}: {per_gpu:?} vs {whole}"
        );
    }
    let ga = one.trained_graph().unwrap().clone();
    let gb = dp.trained_graph().unwrap();
    for (ia, ib) in ga.initializers.iter().zip(&gb.initializers) {
        assert_eq!(ia.name, ib.name);
        let e = rel(&ia.tensor, &ib.tensor);
        assert!(e <= tol, "{path}: '{}' differs by {e:e}", ia.name);
    }
}

#[test]
fn split_batch_shards_axis_zero_evenly() {
    let x = randn(&[6, 3], 1);
    let y = i64s(&[6], &[0, 1, 2, 3, 4, 5]);
    let feeds: HashMap<String, Tensor> = [("x".to_string(), x.clone()), ("y".into(), y)].into();
    let shards = split_batch(&feeds, 3).unwrap();
    assert_eq!(shards.len(), 3);
    for (r, s) in shards.iter().enumerate() {
        assert_eq!(s["x"].shape(), &[2, 3]);
        assert_eq!(s["y"].to_i64_vec(), vec![2 * r as i64, 2 * r as i64 + 1]);
        assert_eq!(
            s["x"].to_f64_vec(),
            x.to_f64_vec()[6 * r..6 * r + 6].to_vec()
        );
    }
    let e = split_batch(&feeds, 4).unwrap_err().to_string();
    assert!(e.contains("split evenly over 4 GPUs"), "{e}");
    let scalar: HashMap<String, Tensor> = [("s".to_string(), Tensor::scalar(1.0f32))].into();
    assert!(split_batch(&scalar, 2).is_err());
}

#[test]
fn data_parallel_refuses_what_it_cannot_run() {
    let d = dims(&[("batch", 8)]);
    let (g, _) = setup("models/mlp.yaml", &d, 1);
    // Not cuda.
    let e = DataParallel::new(g.clone(), SessionOptions::unfused(), 2)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("cuda backend"), "{e}");
    // More GPUs than the machine has (and zero).
    let have = graphrun::backends::cuda::device_count();
    for n in [0, have + 1] {
        let e = DataParallel::new(g.clone(), cuda_opts(d.clone()), n)
            .err()
            .unwrap()
            .to_string();
        // A library error names no command-line flag.
        assert!(
            e.contains(&format!("on {n} GPUs")) && !e.contains("--gpus"),
            "{e}"
        );
    }
    // No training section.
    let mut inference = g.clone();
    inference.training = None;
    let e = DataParallel::new(inference, cuda_opts(d), 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("training"), "{e}");
}

/// `graphrun train models/mlp.yaml -q` with these (space-separated) arguments.
fn train_cli(args: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_graphrun"))
        .args(["train", "models/mlp.yaml", "-q"])
        .args(args.split_whitespace())
        .output()
        .unwrap()
}

#[test]
fn cli_gpus_errors_are_one_line() {
    let out = train_cli("--gpus 2");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cuda backend"), "{err}");
    let out = train_cli("--backend cuda --gpus 2 --batch-size 7");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("split evenly") || err.contains("CUDA") || err.contains("cuda"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// N = 1 through NCCL (runs on any one-GPU machine): the same as a plain session.
#[test]
fn one_gpu_through_nccl_matches_a_session() {
    let Some(_) = gpus(1) else { return };
    one_vs_many("models/mlp.yaml", dims(&[("batch", 16)]), 1, 4, 1e-6);
}

#[test]
fn two_gpus_match_one_on_the_global_batch_mlp() {
    let Some(_) = gpus(2) else { return };
    one_vs_many("models/mlp.yaml", dims(&[("batch", 32)]), 2, 6, 2e-4);
}

/// Gradient accumulation on the GPUs: each worker's shard in micro-batches, the
/// accumulated gradients averaged once (on one GPU through NCCL where there is one).
#[test]
fn accumulated_micro_batches_on_gpus_match_the_whole_batch() {
    let Some(have) = gpus(1) else { return };
    let n = have.min(2);
    one_vs_many_accumulating("models/mlp.yaml", dims(&[("batch", 32)]), n, 4, 5, 2e-4);
    one_vs_many_accumulating(
        "models/gpt_block.yaml",
        dims(&[("batch", 4), ("seq", 32)]),
        n,
        2,
        3,
        2e-4,
    );
}

/// The sharded optimizer (ZeRO stage 1): the steps of the unsharded run, each GPU
/// holding its share of the optimizer state (on one GPU through NCCL where there is one).
#[test]
fn sharded_optimizer_steps_as_the_whole() {
    let Some(have) = gpus(1) else { return };
    let n = have.min(2);
    let adamw = Optimizer::AdamW {
        lr: 0.003,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    for optimizer in [None, Some(adamw)] {
        let v = Variant {
            shard: true,
            optimizer,
            ..Default::default()
        };
        // Adam's steps divide by the gradients' own size, which magnifies the rounding of
        // a different summation order (shards reduced to their owners, not all-reduced)
        // where a gradient is near zero.
        let tol = if v.optimizer.is_some() { 2e-3 } else { 2e-4 };
        one_vs_many_with(
            "models/mlp.yaml",
            dims(&[("batch", 32)]),
            n,
            v.clone(),
            5,
            tol,
        );
        one_vs_many_with(
            "models/gpt_block.yaml",
            dims(&[("batch", 4), ("seq", 32)]),
            n,
            Variant { accumulate: 2, ..v },
            3,
            tol,
        );
    }
}

#[test]
fn two_gpus_match_one_on_the_global_batch_gpt_block() {
    let Some(_) = gpus(2) else { return };
    one_vs_many(
        "models/gpt_block.yaml",
        dims(&[("batch", 4), ("seq", 32)]),
        2,
        4,
        2e-4,
    );
}

/// A worker that fails before its collectives (a bad input on GPU 1) stops the whole
/// step with its error; GPU 0, blocked in the gradient average, is freed by the abort.
#[test]
fn a_failing_worker_stops_every_worker() {
    let Some(_) = gpus(2) else { return };
    let d = dims(&[("batch", 8)]);
    let (g, feeds) = setup("models/mlp.yaml", &d, 3);
    let mut dp = DataParallel::new(g, cuda_opts(d), 2).unwrap();
    dp.train_step(&feeds).unwrap();
    let mut shards = split_batch(&feeds, 2).unwrap();
    shards[1].insert("x".into(), randn(&[4, 100], 9).cast(graphrun::DType::F32));
    let shards: Vec<_> = shards.into_iter().map(std::sync::Arc::new).collect();
    let t0 = std::time::Instant::now();
    let e = dp.train_step_shards(&shards).unwrap_err().to_string();
    assert!(e.contains("GPU 1") && e.contains("'x'"), "{e}");
    eprintln!(
        "failure reported in {:.2} s: {e}",
        t0.elapsed().as_secs_f64()
    );
    // Nothing more runs.
    let e = dp.train_step(&feeds).unwrap_err().to_string();
    assert!(e.contains("stopped"), "{e}");
}

#[test]
fn cli_trains_on_gpus() {
    let Some(have) = gpus(1) else { return };
    let n = have.min(2);
    let dir = std::env::temp_dir().join(format!("graphrun-dp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let save = dir.join("w.safetensors");
    let out = train_cli(&format!(
        "--backend cuda --steps 5 --gpus {n} --batch-size 32 --save {}",
        save.display()
    ));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("trained 5 steps"), "{text}");
    let saved = Tensor::read_safetensors(&save).unwrap();
    assert_eq!(saved.len(), 6);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `graphrun train models/mlp.yaml` as one process of a `world`-process run (the
/// variables torchrun sets), started, not waited for.
fn train_rank(rank: usize, world: usize, port: u16, args: &str) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_graphrun"))
        .args(["train", "models/mlp.yaml", "-q"])
        .args(args.split_whitespace())
        .env("WORLD_SIZE", world.to_string())
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("GRAPHRUN_DP_TIMEOUT", "120")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Two processes of one GPU each (as torchrun starts them) train as one process on two
/// GPUs (with the optimizer sharded and gradients accumulated): the same weights after
/// the same steps; the first process alone writes them (and with 4 GPUs, 2 processes of 2
/// GPUs as 1 of 4). A process that dies stops the other at once, with an error naming it.
#[test]
fn two_processes_train_as_one_process_on_two_gpus() {
    let Some(have) = gpus(2) else { return };
    let dir = std::env::temp_dir().join(format!("graphrun-mp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    processes_match_one_process(&dir, 1);
    // Processes of several GPUs each, where the machine has them.
    if have >= 4 {
        processes_match_one_process(&dir, 2);
    }
    // Rank 1 dies mid-run (killed): rank 0 stops with an error that names it, at
    // once, instead of waiting in a collective for a peer that is gone.
    let port = free_port();
    let long = "--backend cuda --steps 100000000 --batch-size 32";
    let mut r0 = train_rank(0, 2, port, long);
    let mut r1 = train_rank(1, 2, port, long);
    let mut out0 = std::io::BufReader::new(r0.stdout.take().unwrap());
    let mut line = String::new();
    use std::io::BufRead;
    while !line.starts_with("training") {
        line.clear();
        if out0.read_line(&mut line).unwrap() == 0 {
            let _ = r1.kill();
            panic!("rank 0 ended before training: {:?}", r0.wait_with_output());
        }
    }
    // Its epoch lines keep coming: drained, so that it never blocks on a full pipe.
    std::thread::spawn(move || std::io::copy(&mut out0, &mut std::io::sink()));
    std::thread::sleep(std::time::Duration::from_secs(2));
    r1.kill().unwrap();
    let _ = r1.wait();
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = r0.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > std::time::Duration::from_secs(60) {
            let _ = r0.kill();
            panic!("rank 0 still running 60 s after rank 1 died");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut r0.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("rank 1 stopped"), "{err}");
    eprintln!(
        "rank 0 stopped {:.2} s after rank 1 died: {}",
        t0.elapsed().as_secs_f64(),
        err.trim()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two processes of `per` GPUs each train as one process on all `2·per` GPUs (the same
/// saved weights), with the optimizer sharded and gradients accumulated.
fn processes_match_one_process(dir: &std::path::Path, per: usize) {
    let (one, many) = (dir.join("one.safetensors"), dir.join("many.safetensors"));
    let common = "--backend cuda --steps 6 --batch-size 32 --shard-optimizer --accumulate 2";
    let out = train_cli(&format!(
        "{common} --gpus {} --save {}",
        2 * per,
        one.display()
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let port = free_port();
    let args = format!("{common} --gpus {per} --save {}", many.display());
    let ranks: Vec<_> = (0..2).map(|r| train_rank(r, 2, port, &args)).collect();
    for (r, p) in ranks.into_iter().enumerate() {
        let out = p.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "rank {r}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (a, b) = (
        Tensor::read_safetensors(&one).unwrap(),
        Tensor::read_safetensors(&many).unwrap(),
    );
    assert_eq!(a.len(), 6);
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        let e = rel(ta, tb);
        assert!(
            e <= 1e-5,
            "'{na}' differs by {e:e} between 1 process and 2 of {per} GPUs"
        );
    }
    eprintln!(
        "2 processes of {per} GPUs: the weights of 1 process on {}",
        2 * per
    );
}

/// A launcher's variables that are wrong or incomplete, or a multi-process run asked of
/// a backend that cannot do it, end in one line naming what to fix (no GPU needed).
#[test]
fn launcher_errors_are_one_line() {
    let run = |vars: &[(&str, &str)], args: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_graphrun"))
            .args(["train", "models/mlp.yaml", "-q", "--steps", "1"])
            .args(args.split_whitespace())
            .envs(vars.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let master = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")];
    for (vars, args, says) in [
        (vec![("WORLD_SIZE", "2"), ("RANK", "0")], "", "MASTER_ADDR"),
        (
            vec![("WORLD_SIZE", "2"), ("RANK", "3")],
            "",
            "not below WORLD_SIZE=2",
        ),
        (vec![("SLURM_NTASKS", "2")], "", "no rank"),
        (
            [&[("WORLD_SIZE", "2"), ("RANK", "0")][..], &master].concat(),
            "",
            "process 0 of 2",
        ),
        (
            [&[("WORLD_SIZE", "2"), ("RANK", "1")][..], &master].concat(),
            "--batch-size 3",
            "2 processes",
        ),
    ] {
        let (code, err) = run(&vars, args);
        assert_eq!(code, Some(2), "{vars:?}: {err}");
        assert!(err.contains(says), "{vars:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{vars:?}: {err}");
    }
}
