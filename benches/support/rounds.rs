//! Figures of benches that alternate their cases round by round (`capi`,
//! `hardened`): each case's median, each ratio the median of the rounds'
//! ratios (one slow round of the host moves both sides of it).

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The median of the rounds' ratios of `x` to `base`.
pub fn ratio_to(x: &[f64], base: &[f64]) -> f64 {
    median(x.iter().zip(base).map(|(a, b)| a / b).collect())
}

/// Prints a case's line: its label, its median, every round's figure.
pub fn row(label: &str, v: &[f64]) {
    println!("  {label:<40} {:.2}  {v:.2?}", median(v.to_vec()));
}
