//! Shapes in terms of the graph's unbound symbolic dims (`inspect` and `--dot` without
//! `--dim`), found with the concrete inference above rather than a second, symbolic one.
//!
//! Each unbound symbol is given a distinct prime size and the graph is inferred twice,
//! with two disjoint sets of primes. A dim is read back by factoring out the primes: a
//! dim equal in both runs is a number; one that factors into the same product of symbols
//! (times the same number) in both runs is that product, e.g. `batch*seq` after a
//! Reshape; one that is the same symbol plus the same offset in both runs is `seq-1`.
//! Anything else (a division of a symbol, a max of two) is shown as unknown rather than
//! guessed: two runs agreeing by accident on a wrong reading would need the same
//! coincidence for two unrelated sets of primes.

use super::{infer_graph_with, Inferred};
use crate::error::Result;
use crate::graph::{Dim, Graph, HostEval};
use crate::tensor::{DType, Tensor};
use std::collections::{BTreeMap, HashMap};

/// The sizes the two runs give the unbound symbols, in the order the graph first uses
/// them. Primes a little over 1000: large enough that no model's constant dims are made
/// of them by chance (and if one is, the runs disagree and the dim is shown as unknown),
/// small enough that a few symbols multiplied together cannot overflow a size.
pub(crate) const PRIMES: [[usize; 12]; 2] = [
    [
        1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049, 1051, 1061, 1063, 1069,
    ],
    [
        1103, 1109, 1117, 1123, 1129, 1151, 1153, 1163, 1171, 1181, 1187, 1193,
    ],
];

/// The fallback sizes, small enough for models that index tables by a symbolic size. No 2
/// or 3, which are the common factors of dims (`2*seq`), so that a coefficient is not
/// read as a symbol; the first two symbols (batch and sequence, as exporters order them)
/// stay below 14 in both runs; each symbol's two sizes differ by its own amount, so that
/// an offset (`seq-1`) names one symbol.
const SMALL_PRIMES: [[usize; 12]; 2] = [
    [11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53],
    [7, 5, 59, 67, 61, 73, 71, 83, 97, 79, 101, 103],
];

/// A product of symbols times a number: `3*batch*seq^2`. Symbols sorted by name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Monomial {
    /// The number the symbols are multiplied by.
    pub coef: usize,
    /// Each symbol with its exponent, sorted by name.
    pub syms: Vec<(String, u32)>,
}

impl Monomial {
    /// The number `n` (no symbols).
    pub fn constant(n: usize) -> Monomial {
        Monomial {
            coef: n,
            syms: vec![],
        }
    }
    fn times(&self, o: &Monomial) -> Option<Monomial> {
        let mut syms: BTreeMap<String, u32> = self.syms.iter().cloned().collect();
        for (s, e) in &o.syms {
            *syms.entry(s.clone()).or_insert(0) += e;
        }
        Some(Monomial {
            coef: self.coef.checked_mul(o.coef)?,
            syms: syms.into_iter().collect(),
        })
    }
    /// The symbols' part alone, as written: `batch*seq^2` (empty for a number).
    fn sym_text(&self) -> String {
        self.syms
            .iter()
            .map(|(s, e)| {
                if *e == 1 {
                    s.clone()
                } else {
                    format!("{s}^{e}")
                }
            })
            .collect::<Vec<_>>()
            .join("*")
    }
}

impl std::fmt::Display for Monomial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.sym_text();
        match (self.coef, s.is_empty()) {
            (c, true) => write!(f, "{c}"),
            (1, false) => f.write_str(&s),
            (c, false) => write!(f, "{c}*{s}"),
        }
    }
}

/// One dim of a value, for every size of the unbound symbols.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SymDim {
    /// A number, or a product of symbols times a number.
    Product(Monomial),
    /// A symbol plus a (negative or positive) number: a Slice or a Pad of it.
    Offset(String, i64),
    /// Something else; its size is only known once the symbols are.
    Unknown,
}

impl std::fmt::Display for SymDim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SymDim::Product(m) => write!(f, "{m}"),
            SymDim::Offset(s, k) if *k < 0 => write!(f, "{s}{k}"),
            SymDim::Offset(s, k) => write!(f, "{s}+{k}"),
            SymDim::Unknown => f.write_str("?"),
        }
    }
}

/// A value's dtype and its shape in terms of the symbols.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymType {
    /// The element type.
    pub dtype: DType,
    /// Each dim in terms of the symbols.
    pub shape: Vec<SymDim>,
}

impl SymType {
    /// `[batch, 4*seq, 64]`.
    pub fn shape_text(&self) -> String {
        let d: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        format!("[{}]", d.join(", "))
    }
    /// Its size in bytes as one product (None when a dim is not one).
    pub fn bytes(&self) -> Option<Monomial> {
        let mut m = Monomial::constant(self.dtype.size());
        for d in &self.shape {
            match d {
                SymDim::Product(p) => m = m.times(p)?,
                _ => return None,
            }
        }
        Some(m)
    }
}

impl std::fmt::Display for SymType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape_text())
    }
}

/// A sum of monomials (a memory size as a formula of the symbols).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Polynomial {
    /// Coefficient per product of symbols (the empty product is the constant term).
    pub terms: BTreeMap<Vec<(String, u32)>, usize>,
}

impl Polynomial {
    /// Adds a monomial to the sum.
    pub fn add(&mut self, m: &Monomial) {
        let c = self.terms.entry(m.syms.clone()).or_insert(0);
        *c = c.saturating_add(m.coef);
    }
    /// Its value at these sizes (saturating).
    pub fn at(&self, sizes: &BTreeMap<String, usize>) -> Option<usize> {
        let mut total = 0usize;
        for (syms, c) in &self.terms {
            let mut v = *c;
            for (s, e) in syms {
                v = v.saturating_mul(sizes.get(s)?.saturating_pow(*e));
            }
            total = total.saturating_add(v);
        }
        Some(total)
    }
    /// Each term with `unit` applied to its coefficient (e.g. bytes shown as KiB):
    /// highest degree first, `4*n^2 + 16*n + 64`.
    pub fn format(&self, unit: impl Fn(usize) -> String) -> String {
        let mut terms: Vec<(&Vec<(String, u32)>, &usize)> = self.terms.iter().collect();
        terms.sort_by_key(|(syms, _)| std::cmp::Reverse(syms.iter().map(|(_, e)| *e).sum::<u32>()));
        let parts: Vec<String> = terms
            .into_iter()
            .map(|(syms, c)| {
                let m = Monomial {
                    coef: 1,
                    syms: syms.clone(),
                };
                match (m.sym_text(), unit(*c)) {
                    (s, u) if s.is_empty() => u,
                    (s, u) => format!("{u}*{s}"),
                }
            })
            .collect();
        if parts.is_empty() {
            unit(0)
        } else {
            parts.join(" + ")
        }
    }
}

/// Every value's type with the symbols not in `bound` left symbolic. `values` are the
/// graph inputs known on the host (as `infer_graph_with`). With no unbound symbol this is
/// plain inference, every dim a number.
pub fn infer_symbolic(
    g: &Graph,
    bound: &BTreeMap<String, usize>,
    values: &HashMap<String, Tensor>,
    ev: &dyn HostEval,
) -> Result<HashMap<String, SymType>> {
    let free: Vec<String> = g
        .symbols()
        .into_iter()
        .filter(|s| !bound.contains_key(s))
        .collect();
    if free.len() > PRIMES[0].len() {
        crate::bail!(
            Graph,
            "{} unbound symbolic dims are more than shapes can be shown for ({} at most): bind some of {} (--dim on the command line)",
            free.len(),
            PRIMES[0].len(),
            free.join(", ")
        );
    }
    let run = |primes: &[usize]| -> Result<Inferred> {
        let shapes: HashMap<String, Vec<usize>> = g
            .inputs
            .iter()
            .map(|i| {
                let dims = i
                    .shape
                    .iter()
                    .map(|d| match d {
                        Dim::Fixed(n) => *n,
                        Dim::Sym(s) => match free.iter().position(|f| f == s) {
                            Some(k) => primes[k],
                            None => bound[s],
                        },
                    })
                    .collect();
                (i.name.clone(), dims)
            })
            .collect();
        infer_graph_with(g, &shapes, values, ev)
    };
    let both = |primes: &[[usize; 12]; 2]| -> Result<(Inferred, Inferred)> {
        let a = run(&primes[0])?;
        let b = if free.is_empty() {
            a.clone()
        } else {
            run(&primes[1])?
        };
        Ok((a, b))
    };
    // A model may refuse sizes over a thousand (a position table of 32 rows read at
    // Range(0, seq), say): then the small primes.
    let (primes, (a, b)) = match both(&PRIMES) {
        Ok(r) => (&PRIMES, r),
        Err(e) => match both(&SMALL_PRIMES) {
            Ok(r) => (&SMALL_PRIMES, r),
            Err(_) => return Err(e),
        },
    };
    let mut out = HashMap::new();
    for (name, ta) in &a.types {
        let Some(tb) = b.types.get(name) else {
            continue;
        };
        let shape = if ta.shape.len() != tb.shape.len() {
            // The rank itself depends on the sizes (a NonZero of a symbolic input, say).
            vec![SymDim::Unknown]
        } else {
            ta.shape
                .iter()
                .zip(&tb.shape)
                .map(|(&x, &y)| read_dim(x, y, &free, primes))
                .collect()
        };
        out.insert(
            name.clone(),
            SymType {
                dtype: ta.dtype,
                shape,
            },
        );
    }
    Ok(out)
}

/// One dim from its sizes in the two runs (see the module's comment).
fn read_dim(x: usize, y: usize, free: &[String], primes: &[[usize; 12]; 2]) -> SymDim {
    if x == y {
        return SymDim::Product(Monomial::constant(x));
    }
    let (ma, mb) = (factor(x, &primes[0], free), factor(y, &primes[1], free));
    if ma == mb && !ma.syms.is_empty() {
        return SymDim::Product(ma);
    }
    for (k, s) in free.iter().enumerate() {
        let (da, db) = (
            x as i64 - primes[0][k] as i64,
            y as i64 - primes[1][k] as i64,
        );
        if da == db {
            return SymDim::Offset(s.clone(), da);
        }
    }
    SymDim::Unknown
}

fn factor(mut n: usize, primes: &[usize], free: &[String]) -> Monomial {
    let mut syms = vec![];
    for (k, s) in free.iter().enumerate() {
        let mut e = 0;
        while n > 0 && n.is_multiple_of(primes[k]) {
            n /= primes[k];
            e += 1;
        }
        if e > 0 {
            syms.push((s.clone(), e));
        }
    }
    syms.sort();
    Monomial { coef: n, syms }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn dims_read_back_as_numbers_products_and_offsets() {
        let f = free(&["seq", "batch"]);
        for p in [&PRIMES, &SMALL_PRIMES] {
            let (s, b) = ((p[0][0], p[1][0]), (p[0][1], p[1][1]));
            let read = |x, y| read_dim(x, y, &f, p).to_string();
            assert_eq!(read(768, 768), "768");
            assert_eq!(read(s.0, s.1), "seq");
            assert_eq!(read(3 * s.0 * b.0, 3 * s.1 * b.1), "3*batch*seq");
            assert_eq!(read(s.0 * s.0, s.1 * s.1), "seq^2");
            assert_eq!(read(s.0 - 1, s.1 - 1), "seq-1");
            assert_eq!(read(b.0 + 2, b.1 + 2), "batch+2");
            // seq/2 rounded down is neither: unknown, not a wrong number.
            assert_eq!(read_dim(s.0 / 2, s.1 / 2, &f, p), SymDim::Unknown);
        }
    }

    #[test]
    fn polynomials_add_evaluate_and_print() {
        let mut p = Polynomial::default();
        let n = |c, e| Monomial {
            coef: c,
            syms: if e == 0 {
                vec![]
            } else {
                vec![("n".to_string(), e)]
            },
        };
        p.add(&n(4, 2));
        p.add(&n(16, 1));
        p.add(&n(64, 0));
        p.add(&n(4, 1));
        assert_eq!(p.format(|c| c.to_string()), "4*n^2 + 20*n + 64");
        let sizes = BTreeMap::from([("n".to_string(), 10)]);
        assert_eq!(p.at(&sizes), Some(400 + 200 + 64));
        assert_eq!(p.at(&BTreeMap::new()), None);
    }
}
