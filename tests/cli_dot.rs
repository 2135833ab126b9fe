//! `inspect --dot` writes DOT that Graphviz reads for every model: each graph in models/
//! (found by walking the folder, so a new model is covered), fused, unfused and with its
//! backward graph, rendered by `dot -Tsvg`; and a model whose names hold quotes,
//! backslashes and line breaks. With `CI` set (CI installs Graphviz) a missing `dot` is a
//! failure; elsewhere the test says why it skips.

#[path = "common/dirs.rs"]
mod dirs;
use dirs::*;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn graphrun(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graphrun"))
        .args(args)
        .output()
        .unwrap()
}

/// Whether Graphviz's `dot` runs here (see the file's comment for CI).
fn dot_present() -> bool {
    let ok = Command::new("dot")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok && std::env::var_os("CI").is_some() {
        panic!("CI is set but Graphviz's `dot` does not run (.ci/run installs graphviz)");
    }
    if !ok {
        eprintln!(
            "skipping the Graphviz rendering: `dot` is not installed (apt-get install graphviz)"
        );
    }
    ok
}

fn yaml_models(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_models(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml")
            // GPT-2 small's twelve blocks are gpt_block's, and Graphviz takes minutes to
            // lay out its thousand-node backward graph.
            && !p.ends_with("gpt2_124m.yaml")
        {
            out.push(p);
        }
    }
}

/// `inspect MODEL --dot FILE extra...`, then `dot -Tsvg FILE`; the DOT text.
fn render(model: &str, extra: &[&str], dir: &Path, check_dot: bool) -> String {
    let file = dir.join("g.dot");
    let mut args = vec!["inspect", model, "--dot", file.to_str().unwrap()];
    args.extend(extra);
    let o = graphrun(&args);
    assert!(
        o.status.success(),
        "{model} {extra:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = std::fs::read_to_string(&file).unwrap();
    if check_dot {
        let r = Command::new("dot")
            .args(["-Tsvg", "-o"])
            .arg(dir.join("g.svg"))
            .arg(&file)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&r.stderr);
        // dot exits 0 on some syntax errors it recovers from, but still reports them.
        assert!(
            r.status.success() && !err.contains("rror"),
            "{model} {extra:?}: dot failed: {err}\n{text}"
        );
        let svg = std::fs::read_to_string(dir.join("g.svg")).unwrap();
        assert!(svg.contains("<svg"), "{model}: {svg}");
    }
    text
}

#[test]
fn every_model_renders_through_graphviz() {
    let dot = dot_present();
    let d = tmpdir("models");
    let mut models = vec![];
    yaml_models(Path::new("models"), &mut models);
    models.sort();
    assert!(models.len() >= 4, "{models:?}");
    models.push("tests/data/odd_names.yaml".into());
    for m in &models {
        let m = m.to_str().unwrap();
        for extra in [&[][..], &["--no-fuse"], &["--backward"]] {
            let text = render(m, extra, &d, dot);
            assert!(text.starts_with("digraph "), "{m}: {text}");
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn edges_carry_types_and_fused_nodes_say_what_they_absorbed() {
    let dot = dot_present();
    let d = tmpdir("labels");
    // Without --dim the symbols stay symbols (the model's defaults are only defaults).
    let text = render("models/gpt_block.yaml", &[], &d, dot);
    assert!(
        text.contains("[label=\"qkv\\nf32[batch, seq, 3072]\"]"),
        "{text}"
    );
    assert!(
        text.contains("\"n:fc1\" [label=\"fc1\\nFusedMatMul\\n(bias, gelu_tanh)\", style=filled"),
        "{text}"
    );
    assert!(text.contains("FusedMatMul\\n(bias, residual)"), "{text}");
    assert!(
        text.contains("Attention\\n(scale 0.125, causal, softmax"),
        "{text}"
    );
    // --dim gives numbers.
    let text = render(
        "models/gpt_block.yaml",
        &["--dim", "batch=2", "--dim", "seq=8"],
        &d,
        dot,
    );
    assert!(text.contains("[label=\"qkv\\nf32[2, 8, 3072]\"]"), "{text}");
    assert!(!text.contains("batch"), "{text}");
    // Names are quoted, not spliced: a quote or backslash in a name cannot end a string.
    let text = render("tests/data/odd_names.yaml", &[], &d, dot);
    assert!(
        text.contains("\"v:x \\\"in\\\" \\\\\" [label=\"x \\\"in\\\" \\\\\\nf32[n, 4]\""),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
