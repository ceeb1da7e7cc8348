//! Ordinary least squares over a few features: `y ≈ β₀ + β₁·x₁ + … + βₖ·xₖ`, solved from the
//! normal equations `(XᵀX + λI)β = Xᵀy` by Gaussian elimination with partial pivoting. `k` is
//! tiny here (one or two engine metrics), so nothing smarter is needed. A small ridge term `λ`
//! (on the slopes only, relative to the features' scale) keeps a fit on nearly collinear
//! samples — every engine at the same batch, say — finite; it then leans towards the mean.

/// Most features a fit may have.
pub(crate) const MAX_FEATURES: usize = 3;

/// A linear model fitted by [`fit`]: an intercept and one slope per feature.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearFit {
    /// `β₀`.
    pub intercept: f64,
    /// `β₁ … βₖ`.
    pub slopes: Vec<f64>,
}

impl LinearFit {
    /// The model's value at `x` (missing features count as 0, extra ones are ignored).
    #[must_use]
    pub fn predict(&self, x: &[f64]) -> f64 {
        self.intercept
            + self
                .slopes
                .iter()
                .zip(x.iter().chain(std::iter::repeat(&0.0)))
                .map(|(b, v)| b * v)
                .sum::<f64>()
    }
}

/// Fits `y` on the features of `samples` (`(features, y)`; every sample has the same number of
/// features, at most three). `None` with no sample, with non-finite values, with
/// samples of different widths, or when the system is singular even with the ridge term.
#[must_use]
pub fn fit(samples: &[(Vec<f64>, f64)]) -> Option<LinearFit> {
    let k = samples.first()?.0.len();
    if k > MAX_FEATURES
        || samples
            .iter()
            .any(|(x, y)| x.len() != k || !y.is_finite() || x.iter().any(|v| !v.is_finite()))
    {
        return None;
    }
    let n = k + 1;
    // Normal equations with a leading column of ones.
    let mut a = [[0.0f64; MAX_FEATURES + 2]; MAX_FEATURES + 1];
    for (x, y) in samples {
        let row: Vec<f64> = std::iter::once(1.0).chain(x.iter().copied()).collect();
        for i in 0..n {
            for j in 0..n {
                a[i][j] += row[i] * row[j];
            }
            a[i][n] += row[i] * y;
        }
    }
    // Ridge on the slopes, scaled to each feature's own magnitude so units do not matter.
    for (i, row) in a.iter_mut().enumerate().take(n).skip(1) {
        row[i] += 1e-9 * row[i].max(1e-12) + 1e-12;
    }
    solve(&mut a, n).map(|beta| LinearFit {
        intercept: beta[0],
        slopes: beta[1..].to_vec(),
    })
}

/// Solves the `n × n` system in the augmented matrix `a` (column `n` is the right side).
fn solve(a: &mut [[f64; MAX_FEATURES + 2]; MAX_FEATURES + 1], n: usize) -> Option<Vec<f64>> {
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col];
        for (r, row) in a.iter_mut().enumerate().take(n) {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row.iter_mut().zip(pivot_row.iter()).take(n + 1).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    let beta: Vec<f64> = (0..n).map(|i| a[i][n] / a[i][i]).collect();
    beta.iter().all(|b| b.is_finite()).then_some(beta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_exact_plane_is_recovered() {
        let samples: Vec<(Vec<f64>, f64)> = [(1.0, 10.0), (8.0, 10.0), (1.0, 500.0), (4.0, 2000.0)]
            .iter()
            .map(|&(b, c)| (vec![b, c], 4.5 + 2.6 * b + 0.006 * c))
            .collect();
        let f = fit(&samples).unwrap();
        assert!((f.intercept - 4.5).abs() < 1e-6, "{f:?}");
        assert!((f.slopes[0] - 2.6).abs() < 1e-6, "{f:?}");
        assert!((f.slopes[1] - 0.006).abs() < 1e-9, "{f:?}");
    }

    #[test]
    fn no_samples_mixed_widths_and_nan_give_no_fit() {
        assert!(fit(&[]).is_none());
        assert!(fit(&[(vec![1.0], 1.0), (vec![1.0, 2.0], 1.0)]).is_none());
        assert!(fit(&[(vec![f64::NAN], 1.0)]).is_none());
        assert!(fit(&[(vec![1.0, 2.0, 3.0, 4.0], 1.0)]).is_none());
    }

    #[test]
    fn collinear_samples_still_fit_their_mean() {
        // Every sample at the same x: the slope is undetermined; the ridge keeps it finite
        // and the prediction at that x is the samples' mean.
        let f = fit(&[(vec![8.0], 20.0), (vec![8.0], 22.0)]).unwrap();
        assert!((f.predict(&[8.0]) - 21.0).abs() < 1e-3, "{f:?}");
    }

    proptest! {
        #[test]
        fn a_line_with_two_distinct_points_is_exact(a in -100.0f64..100.0, b in -10.0f64..10.0,
                                                    xs in proptest::collection::vec(0.0f64..1000.0, 2..20)) {
            prop_assume!(xs.iter().any(|x| (x - xs[0]).abs() > 1.0));
            let samples: Vec<_> = xs.iter().map(|&x| (vec![x], a + b * x)).collect();
            let f = fit(&samples).unwrap();
            for &x in &xs {
                prop_assert!((f.predict(&[x]) - (a + b * x)).abs() < 1e-4 * (1.0 + (a + b * x).abs()));
            }
        }
    }
}
