//! Graph → Graph rewrites (SPEC §3) and the pass manager that runs them.
//!
//! A rule is a plain function registered under an anchor op: it looks at one node and its
//! neighbours through the matcher in `pattern.rs` and returns `Option<Patch>`. The driver
//! applies patches atomically, re-infers shapes and runs the rules to a fixed point,
//! logging each applied rule by name. The pipeline order is SPEC §3's.

mod attention;
mod attention_flat;
pub mod autodiff;
mod const_fold;
mod conv;
mod conv_epilogue;
mod cse;
mod dce;
mod epilogue;
mod gated;
pub mod layout;
mod noop;
mod norm;
pub(crate) mod pattern;
mod rotary;
pub mod weight_layout;

use crate::error::{Error, Result};
use crate::graph::{validate, Graph, HostEval, Op};
use pattern::{Ctx, Facts, Patch, Why};
use std::collections::{BTreeMap, HashMap};

/// The default pipeline, in order; these are the names `PassOptions::disabled` takes.
pub const PASSES: [&str; 10] = [
    "constant_folding",
    "dead_node_elimination",
    "noop_removal",
    "conv_fusion",
    "normalization_fusion",
    "rotary_fusion",
    "attention_fusion",
    "matmul_epilogue_fusion",
    "residual_norm_fusion",
    "cse",
];

/// How to run the pipeline. `Default` (given in `exec`, which knows the backends) runs
/// every pass with the CPU reference evaluator.
#[derive(Clone, Debug)]
pub struct PassOptions {
    /// Passes switched off, by name (see `PASSES`).
    pub disabled: Vec<String>,
    /// The graph will be trained: Dropout is kept (it is a no-op only at inference).
    pub training: bool,
    /// Evaluates nodes on the host: shape arithmetic while inferring, constant folding.
    pub eval: &'static dyn HostEval,
}

/// What one pass did.
#[derive(Clone, Debug, Default)]
pub struct PassReport {
    /// The pass's name (one of `PASSES`).
    pub name: &'static str,
    /// Whether it ran (false when `PassOptions::disabled` names it).
    pub enabled: bool,
    /// Rewrites applied (rule firings, nodes and initializers removed).
    pub rewrites: usize,
    /// How many times each rule fired.
    pub rules: BTreeMap<&'static str, usize>,
}

/// What the pipeline did, for `graphrun inspect`.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Each pass of the pipeline, in order.
    pub passes: Vec<PassReport>,
    /// Each applied rule in order: "pass: rule at 'node'".
    pub log: Vec<String>,
    /// For each MatMul/Gemm and Softmax left unfused, and each Conv whose following
    /// per-channel map was not folded: which condition of which rule failed.
    pub explain: Vec<String>,
}

impl Report {
    /// Times `rule` fired over all passes.
    pub fn fired(&self, rule: &str) -> usize {
        self.passes.iter().filter_map(|p| p.rules.get(rule)).sum()
    }
    /// Rewrites applied by all passes together.
    pub fn total(&self) -> usize {
        self.passes.iter().map(|p| p.rewrites).sum()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for p in &self.passes {
            if !p.enabled {
                writeln!(f, "{:<24} disabled", p.name)?;
                continue;
            }
            let rules: Vec<String> = p.rules.iter().map(|(r, n)| format!("{r} ×{n}")).collect();
            let detail = if rules.is_empty() {
                String::new()
            } else {
                format!(" ({})", rules.join(", "))
            };
            writeln!(
                f,
                "{:<24} {} rewrite{}{detail}",
                p.name,
                p.rewrites,
                if p.rewrites == 1 { "" } else { "s" }
            )?;
        }
        Ok(())
    }
}

/// Runs the default pipeline (SPEC §3) on a copy of `g`. The result is validated.
pub fn optimize(g: &Graph, opts: &PassOptions) -> Result<(Graph, Report)> {
    for d in &opts.disabled {
        if !PASSES.contains(&d.as_str()) {
            crate::bail!(
                Input,
                "unknown pass '{d}'; the passes are {}",
                PASSES.join(", ")
            );
        }
    }
    let mut g = g.clone();
    let mut report = Report::default();
    // Node name → why the last fusion rule that looked at it did not fire.
    let mut why: HashMap<String, String> = HashMap::new();
    let mut left: HashMap<String, String> = HashMap::new();
    for name in PASSES {
        let mut st = PassState {
            report: PassReport {
                name,
                enabled: true,
                ..Default::default()
            },
            log: vec![],
            why: HashMap::new(),
            left: HashMap::new(),
            eval: opts.eval,
        };
        if opts.disabled.iter().any(|d| d == name) {
            st.report.enabled = false;
            report.passes.push(st.report);
            continue;
        }
        g = match name {
            "constant_folding" => drive(g, const_fold::RULES, &mut st)?,
            "dead_node_elimination" => dce::run(g, &mut st)?,
            "noop_removal" => drive(g, &noop::rules(opts.training), &mut st)?,
            "conv_fusion" => drive(g, conv::RULES, &mut st)?,
            "normalization_fusion" => drive(g, norm::RULES, &mut st)?,
            "rotary_fusion" => drive(g, rotary::RULES, &mut st)?,
            "attention_fusion" => drive(g, attention::RULES, &mut st)?,
            "matmul_epilogue_fusion" => drive(g, epilogue::RULES, &mut st)?,
            "residual_norm_fusion" => drive(g, norm::RESIDUAL_RULES, &mut st)?,
            _ => drive(g, cse::RULES, &mut st)?,
        };
        // A pass that rewrote nothing left the graph it was given (valid already).
        if st.report.rewrites > 0 {
            validate::validate(&g, opts.eval)
                .map_err(|e| Error::Graph(format!("pass {name} left an invalid graph: {e}")))?;
        }
        why.extend(st.why);
        left.extend(st.left);
        report.log.append(&mut st.log);
        report.passes.push(st.report);
    }
    report.explain = explain(&g, &why, &left, opts);
    Ok((g, report))
}

/// `g` for running forward only: every initializer becomes a constant nothing trains, and
/// the pipeline runs again, so that constants fold into each other (a BatchNormalization
/// into the Conv before it, `conv_affine`). Its gradients are then no longer those of the
/// weights: a graph to differentiate or train is optimized by `optimize` alone.
pub fn freeze(g: &Graph, opts: &PassOptions) -> Result<(Graph, Report)> {
    let mut frozen = g.clone();
    for i in &mut frozen.initializers {
        i.trainable = false;
    }
    // No training step runs, so no state update does either.
    frozen.updates.clear();
    optimize(&frozen, opts)
}

/// One line per MatMul/Gemm/Softmax the fusion passes left in the graph, and per fused
/// MatMul that stopped before a bias, activation or residual it could have taken.
fn explain(
    g: &Graph,
    why: &HashMap<String, String>,
    left: &HashMap<String, String>,
    opts: &PassOptions,
) -> Vec<String> {
    let off = |p: &str| opts.disabled.iter().any(|d| d == p);
    g.nodes
        .iter()
        .filter_map(|n| {
            let pass = match n.op {
                Op::MatMul | Op::Gemm { .. } => "matmul_epilogue_fusion",
                Op::Softmax { .. } => "attention_fusion",
                // A convolution is reported when something after it could have folded.
                Op::Conv { .. } if off("conv_fusion") => return None,
                Op::Conv { .. } => {
                    // Each rule's reason ("rule: reason", joined by "; "), less the
                    // usual "nothing of mine follows".
                    let quiet = [
                        format!("conv_affine: {}", conv::NOTHING_FOLLOWS),
                        format!("conv_epilogue: {}", conv_epilogue::NOTHING_FOLLOWS),
                    ];
                    let r = why.get(&n.name)?;
                    let told: Vec<&str> = r
                        .split("; ")
                        .filter(|p| !quiet.iter().any(|q| q == p))
                        .collect();
                    if told.is_empty() {
                        return None;
                    }
                    return Some(format!(
                        "Conv '{}': what follows it is not fused: {}",
                        n.name,
                        told.join("; ")
                    ));
                }
                Op::FusedMatMul { activation, .. } | Op::FusedConv { activation, .. } => {
                    let note = left.get(&n.name)?;
                    return Some(format!(
                        "{} '{}' (activation {}): {note}",
                        n.op.name(),
                        n.name,
                        activation.name()
                    ));
                }
                _ => return None,
            };
            let reason = match why.get(&n.name) {
                _ if off(pass) => format!("{pass} is disabled"),
                Some(r) => r.clone(),
                None => "no rule looked at it".into(),
            };
            Some(format!("{} '{}': {reason}", n.op.name(), n.name))
        })
        .collect()
}

/// A pass's running record.
pub(crate) struct PassState {
    pub report: PassReport,
    pub log: Vec<String>,
    pub why: HashMap<String, String>,
    /// Node name → what a rewrite that made the node left outside it, and why.
    pub left: HashMap<String, String>,
    pub eval: &'static dyn HostEval,
}

impl PassState {
    pub fn fired(&mut self, rule: &'static str, node: &str) {
        self.report.rewrites += 1;
        *self.report.rules.entry(rule).or_insert(0) += 1;
        self.log
            .push(format!("{}: {rule} at '{node}'", self.report.name));
    }
}

/// A rewrite rule: its name, the ops it anchors on, and the matcher.
pub(crate) struct Rule {
    pub name: &'static str,
    pub anchor: fn(&Op) -> bool,
    pub run: fn(&Ctx, usize, &mut Why) -> Option<Patch>,
}

pub(crate) fn any_op(_: &Op) -> bool {
    true
}

/// The greedy fixed-point driver: scans nodes in execution order and collects the patches
/// rules return, taking in one scan only patches that remove no node another one's
/// footprint holds (the nodes it removes and their neighbours: a neighbour two patches
/// only read, such as one weight's Transpose read by every step of an unrolled
/// recurrence, is shared) and whose new names do not clash; applies them
/// together and scans again. Shapes are re-inferred once a scan finds nothing on stale
/// facts. Ends when a scan on fresh facts finds nothing; the reasons recorded in that
/// last scan are the ones `explain` reports. Batching keeps long chains of rewrites
/// near-linear instead of one full rescan per rewrite.
pub(crate) fn drive(mut g: Graph, rules: &[Rule], st: &mut PassState) -> Result<Graph> {
    let mut facts = Facts::new(&g, st.eval);
    let mut fresh = true;
    for _ in 0..100_000 {
        let mut why: HashMap<String, String> = HashMap::new();
        let batch = {
            let cx = Ctx::new(&g, &facts)?;
            let mut batch: Vec<(&'static str, String, Patch)> = vec![];
            // Nodes the batch removes, and the neighbourhoods it matched on.
            let mut removed: std::collections::HashSet<usize> = Default::default();
            let mut seen: std::collections::HashSet<usize> = Default::default();
            let mut names: std::collections::HashSet<String> = Default::default();
            for &i in &cx.order {
                let node = cx.node(i);
                for r in rules.iter().filter(|r| (r.anchor)(&node.op)) {
                    let mut w = Why::default();
                    if let Some(p) = (r.run)(&cx, i, &mut w) {
                        let fp = cx.footprint(&p);
                        let new_names: Vec<String> = p
                            .add
                            .iter()
                            .flat_map(|n| n.outputs.iter().chain([&n.name]).cloned())
                            .chain(p.inits.iter().map(|i| i.name.clone()))
                            .filter(|s| !s.is_empty())
                            .collect();
                        let first = batch.is_empty();
                        if first
                            || (!p.remove.is_empty()
                                && fp.is_disjoint(&removed)
                                && p.remove.iter().all(|i| !seen.contains(i))
                                && new_names.iter().all(|n| !names.contains(n)))
                        {
                            removed.extend(p.remove.iter().copied());
                            seen.extend(fp);
                            names.extend(new_names);
                            batch.push((r.name, node.name.clone(), p));
                        }
                        break;
                    }
                    if let Some(reason) = w.0 {
                        let e = why.entry(node.name.clone()).or_default();
                        e.push_str(&format!(
                            "{}{}: {reason}",
                            if e.is_empty() { "" } else { "; " },
                            r.name
                        ));
                    }
                }
                // A patch that adds without removing is applied alone.
                if batch.first().is_some_and(|(_, _, p)| p.remove.is_empty()) {
                    break;
                }
            }
            batch
        };
        if batch.is_empty() {
            if fresh {
                st.why = why;
                return Ok(g);
            }
            facts = Facts::new(&g, st.eval);
            fresh = true;
            continue;
        }
        let mut patches = vec![];
        for (rule, node, mut patch) in batch {
            st.fired(rule, &node);
            if let Some(note) = patch.note.take() {
                st.left.insert(node, format!("{rule}: {note}"));
            }
            patches.push(patch);
        }
        g = pattern::apply_all(g, patches);
        fresh = false;
    }
    crate::bail!(Graph, "pass {} did not reach a fixed point", st.report.name)
}
