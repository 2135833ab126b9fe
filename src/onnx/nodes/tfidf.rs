//! TfIdfVectorizer over integer tokens, written as comparisons and sums.
//!
//! ONNX's definition walks a trie of the pool's n-grams from every start position for
//! every skip distance. What it counts comes to this: an n-gram g of length k (within
//! [min_gram_length, max_gram_length]) is counted once for every distance d and start s
//! with X[s + j·d] = g[j] for all j < k, where d runs over 1..=max_skip_count + 1 for
//! k ≥ 2 and is 1 for unigrams. So for each length k and distance d the importer compares
//! k shifted slices of X, `[B, 1, L]`, with the pool's k-th tokens, `[G, 1]`, ANDs them
//! and sums over the L positions: counts `[B, G]` for the G n-grams of that length. A
//! product with a 0/1 matrix `[G, O]` then adds each n-gram's count into its output column
//! (`ngram_indexes`); counts are whole numbers, exact in f32 below 2^24. The weighting
//! (TF, IDF, TFIDF) follows. X's length need not be known: slices past its end are empty
//! and sum to 0.

use super::composite::{bin, check_size, inputs, squeeze, unsqueeze, Attrs, Axes};
use super::Importer;
use crate::error::{Error, Result};
use crate::graph::op::{Attr, ReduceKind};
use crate::graph::{BinaryOp, Op};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;

pub(super) const TFIDF: &str = "TfIdfVectorizer";

/// Weighting of the counts.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Tf,
    Idf,
    TfIdf,
}

impl Importer<'_> {
    pub(super) fn tfidf(&mut self, n: &NodeProto, shown: &str, attrs: Vec<Attr>) -> Result<()> {
        let mut a = Attrs::of(n, shown, attrs)?;
        let what = a.what.clone();
        let required = |a: &mut Attrs, key: &str| -> Result<i64> {
            a.opt_int(key)?.ok_or_else(|| a.refuse(key, "is required"))
        };
        let min_len = required(&mut a, "min_gram_length")?;
        let max_len = required(&mut a, "max_gram_length")?;
        let max_skip = required(&mut a, "max_skip_count")?;
        let mode = match a.string("mode", "")?.as_str() {
            "TF" => Mode::Tf,
            "IDF" => Mode::Idf,
            "TFIDF" => Mode::TfIdf,
            m => return Err(a.refuse("mode", &format!("must be TF, IDF or TFIDF, got '{m}'"))),
        };
        let counts = a
            .opt_ints("ngram_counts")?
            .ok_or_else(|| a.refuse("ngram_counts", "is required"))?;
        let indexes = a
            .opt_ints("ngram_indexes")?
            .ok_or_else(|| a.refuse("ngram_indexes", "is required"))?;
        let pool = a.opt_ints("pool_int64s")?;
        if a.take("pool_strings").is_some() {
            return Err(Error::Graph(format!(
                "{what}: pool_strings needs string tensors, which graphrun does not have; \
                 integer tokens (pool_int64s) are taken"
            )));
        }
        let pool = pool.ok_or_else(|| a.refuse("pool_int64s", "is required"))?;
        let weights = a.floats("weights")?;
        a.finish()?;
        if min_len < 1 || max_len < min_len {
            return Err(Error::Graph(format!(
                "{what}: gram lengths must satisfy 1 <= min_gram_length <= max_gram_length, got {min_len} and {max_len}"
            )));
        }
        if max_skip < 0 {
            return Err(a.refuse("max_skip_count", &format!("must be >= 0, got {max_skip}")));
        }
        let grams = ngrams(&what, &pool, &counts, &indexes, min_len, max_len)?;
        let width = indexes.iter().copied().max().unwrap_or(-1) + 1;
        if width < 1 {
            return Err(a.refuse("ngram_indexes", "must not be empty"));
        }
        let width = width as usize;
        if !weights.is_empty() && weights.len() != width {
            return Err(a.refuse(
                "weights",
                &format!("has {} values for {width} output columns", weights.len()),
            ));
        }
        let (ins, _) = inputs(n, &what, (1, 1), 1)?;
        let x = ins[0].clone();
        let rank = match self.ranks.get(&x) {
            Some(&r @ (1 | 2)) => r,
            Some(r) => {
                return Err(Error::Graph(format!(
                    "{what}: X must be [C] or [B, C], got rank {r}"
                )))
            }
            None => {
                return Err(Error::Graph(format!(
                    "{what}: the rank of X is unknown: declare it (a value_info or input type)"
                )))
            }
        };
        // Tokens compared as i64, whatever integer type X has.
        let x = self.val(n, "x_i64", Op::Cast { to: DType::I64 }, vec![x]);
        let x = match rank {
            1 => self.val(n, "rows", unsqueeze(0), vec![x]),
            _ => x,
        };
        let x3 = self.val(n, "x3", unsqueeze(1), vec![x.clone()]);
        // Counts of every counted n-gram, [B, G] per (length, distance), summed.
        let mut by_len: BTreeMap<usize, Vec<&Gram>> = BTreeMap::new();
        for g in &grams {
            by_len.entry(g.tokens.len()).or_default().push(g);
        }
        let mut parts = Vec::new();
        let mut order = Vec::new();
        for (&k, gs) in &by_len {
            let distances = if k == 1 { 1 } else { max_skip + 1 };
            let mut total: Option<String> = None;
            for d in 1..=distances {
                let tag = format!("k{k}_d{d}");
                let mut hit: Option<String> = None;
                for j in 0..k {
                    let start = j as i64 * d;
                    let end = match (k - 1 - j) as i64 * d {
                        0 => i64::MAX,
                        back => -back,
                    };
                    let s = self.ints_const(n, &format!("{tag}_start{j}"), &[start])?;
                    let e = self.ints_const(n, &format!("{tag}_end{j}"), &[end])?;
                    let ax = self.ints_const(n, &format!("{tag}_axis{j}"), &[-1])?;
                    let xs = self.val(
                        n,
                        &format!("{tag}_x{j}"),
                        Op::Slice,
                        vec![x3.clone(), s, e, ax],
                    );
                    let toks: Vec<i64> = gs.iter().map(|g| g.tokens[j]).collect();
                    let t = self.constant(
                        n,
                        &format!("{tag}_tok{j}"),
                        Tensor::from_vec(&[toks.len(), 1], toks)?,
                    );
                    let eq = self.val(
                        n,
                        &format!("{tag}_eq{j}"),
                        bin(BinaryOp::Equal),
                        vec![xs, t],
                    );
                    hit = Some(match hit {
                        None => eq,
                        Some(h) => {
                            self.val(n, &format!("{tag}_and{j}"), bin(BinaryOp::And), vec![h, eq])
                        }
                    });
                }
                let hit = hit.expect("k >= 1");
                let hit = self.val(
                    n,
                    &format!("{tag}_hit"),
                    Op::Cast { to: DType::F32 },
                    vec![hit],
                );
                let c = self.reduce(
                    n,
                    &format!("{tag}_count"),
                    ReduceKind::Sum,
                    &hit,
                    &Axes::Fixed(vec![-1]),
                    false,
                );
                total = Some(match total {
                    None => c,
                    Some(t) => self.val(n, &format!("{tag}_total"), bin(BinaryOp::Add), vec![t, c]),
                });
            }
            parts.push(total.expect("at least one distance"));
            order.extend(gs.iter().map(|g| g.column));
        }
        let counts = if parts.is_empty() {
            // No n-gram is counted: zeros [B, width], from X's batch dim.
            let b = self.val(n, "batch", super::composite::shape(0, Some(1)), vec![x]);
            let w = self.ints_const(n, "width", &[width as i64])?;
            let dims = self.val(n, "dims", Op::Concat { axis: 0 }, vec![b, w]);
            let zero = self.constant(n, "zero", Tensor::scalar(0f32));
            self.val(n, "counts", Op::Expand, vec![zero, dims])
        } else {
            let c = if parts.len() == 1 {
                parts.pop().expect("one part")
            } else {
                self.val(n, "gram_counts", Op::Concat { axis: -1 }, parts)
            };
            check_size(&what, DType::F32, &[order.len(), width])?;
            let mut scatter = vec![0f32; order.len() * width];
            for (i, &col) in order.iter().enumerate() {
                scatter[i * width + col] = 1.0;
            }
            let m = self.constant(
                n,
                "columns",
                Tensor::from_vec(&[order.len(), width], scatter)?,
            );
            self.val(n, "counts", Op::MatMul, vec![c, m])
        };
        let w = (!weights.is_empty()).then(|| Tensor::from_vec(&[width], weights.clone()));
        let y = match (mode, w) {
            (Mode::Tf, _) | (Mode::TfIdf, None) => counts,
            (Mode::TfIdf, Some(w)) => {
                let w = self.constant(n, "weights", w?);
                self.val(n, "weighted", bin(BinaryOp::Mul), vec![counts, w])
            }
            (Mode::Idf, w) => {
                let zero = self.constant(n, "zero", Tensor::scalar(0f32));
                let seen = self.val(
                    n,
                    "seen",
                    bin(BinaryOp::Greater),
                    vec![counts, zero.clone()],
                );
                let w = match w {
                    Some(w) => self.constant(n, "weights", w?),
                    None => self.constant(n, "one", Tensor::scalar(1f32)),
                };
                self.val(n, "idf", Op::Where, vec![seen, w, zero])
            }
        };
        match rank {
            1 => self.out(n, 0, squeeze(0), vec![y]),
            _ => self.out(n, 0, Op::Identity, vec![y]),
        }
        Ok(())
    }
}

/// One counted n-gram: its tokens and the output column its count goes to.
struct Gram {
    tokens: Vec<i64>,
    column: usize,
}

/// The pool's n-grams of the counted lengths, in pool order. `ngram_counts[i]` is where
/// the (i+1)-grams start in the pool; the n-gram numbered m over all lengths (counted or
/// not) goes to column `ngram_indexes[m]`. An n-gram the pool repeats is counted once, at
/// its last place, as ONNX's reference (a trie whose later entry wins) counts it.
fn ngrams(
    what: &str,
    pool: &[i64],
    counts: &[i64],
    indexes: &[i64],
    min_len: i64,
    max_len: i64,
) -> Result<Vec<Gram>> {
    let bad = |msg: String| Error::Graph(format!("{what}: {msg}"));
    let mut grams: Vec<Gram> = Vec::new();
    let mut id = 0usize;
    for (i, &start) in counts.iter().enumerate() {
        let end = counts.get(i + 1).copied().unwrap_or(pool.len() as i64);
        if start < 0 || end < start || end > pool.len() as i64 {
            return Err(bad(format!(
                "ngram_counts {counts:?} do not split a pool of {} tokens",
                pool.len()
            )));
        }
        let k = i + 1;
        let items = &pool[start as usize..end as usize];
        if !items.len().is_multiple_of(k) {
            return Err(bad(format!(
                "the {k}-grams take {} pool tokens, not a multiple of {k}",
                items.len()
            )));
        }
        for chunk in items.chunks(k) {
            let counted = (min_len..=max_len).contains(&(k as i64));
            if counted {
                let col = *indexes.get(id).ok_or_else(|| {
                    bad(format!(
                        "ngram_indexes has {} entries, fewer than the pool's n-grams",
                        indexes.len()
                    ))
                })?;
                if col < 0 {
                    return Err(bad(format!("ngram_indexes has a negative entry {col}")));
                }
                grams.retain(|g| g.tokens != chunk);
                grams.push(Gram {
                    tokens: chunk.to_vec(),
                    column: col as usize,
                });
            }
            id += 1;
        }
    }
    Ok(grams)
}
