//! Pearson's chi-squared test of homogeneity, for tests that compare two
//! samplers' token frequencies.

/// The Wilson–Hilferty approximation of the chi-squared quantile with `df`
/// degrees of freedom at the upper-tail normal quantile `z`.
pub fn chi2_quantile(df: f64, z: f64) -> f64 {
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Pearson's two-sample (homogeneity) statistic for counts `a` and `b`
/// over the same categories, pooling categories expected fewer than 5
/// times into one; returns it with its degrees of freedom.
pub fn homogeneity(
    a: &std::collections::HashMap<u32, f64>,
    b: &std::collections::HashMap<u32, f64>,
) -> (f64, f64) {
    let (na, nb): (f64, f64) = (a.values().sum(), b.values().sum());
    let mut keys: Vec<u32> = a.keys().chain(b.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut other = (0.0, 0.0);
    for k in keys {
        let (x, y) = (
            a.get(&k).copied().unwrap_or(0.0),
            b.get(&k).copied().unwrap_or(0.0),
        );
        let total = x + y;
        if total * na.min(nb) / (na + nb) < 5.0 {
            other.0 += x;
            other.1 += y;
        } else {
            cells.push((x, y));
        }
    }
    if other.0 + other.1 > 0.0 {
        cells.push(other);
    }
    let mut stat = 0.0;
    for &(x, y) in &cells {
        let total = x + y;
        let (ex, ey) = (total * na / (na + nb), total * nb / (na + nb));
        stat += (x - ex).powi(2) / ex + (y - ey).powi(2) / ey;
    }
    (stat, cells.len() as f64 - 1.0)
}

/// Asserts that two samplers' token counts agree at every position
/// (`a[i]` against `b[i]`), under the homogeneity test at p = 0.001
/// (z = 3.09). Position `i` is named as output token `i + first`.
pub fn assert_same_distributions(
    a: &[std::collections::HashMap<u32, f64>],
    b: &[std::collections::HashMap<u32, f64>],
    first: usize,
) {
    for (pos, (x, y)) in a.iter().zip(b).enumerate() {
        let (stat, df) = homogeneity(x, y);
        let limit = chi2_quantile(df, 3.09);
        assert!(
            stat < limit,
            "token {}: chi-squared {stat:.1} over {df} degrees of freedom exceeds {limit:.1}",
            pos + first
        );
    }
}
