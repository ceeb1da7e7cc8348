//! Percentiles of the simulator's figures: exact ones over a list (TTFT, one value per
//! request) and a log-bucketed histogram for the many weighted ITL samples (one per decode
//! step, weighted by the tokens it produced), whose percentile is the upper edge of its
//! bucket: at most 1 % above the true value, never below it.

/// The `q`-quantile (nearest rank) of `v`, sorted in place; `None` when empty.
pub fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Smallest value a bucket tells apart (seconds).
const BASE: f64 = 1e-5;
/// Ratio between bucket edges.
const RATIO: f64 = 1.01;
/// Buckets: 10 µs × 1.01^2100 ≈ 1.2e4 s.
const BUCKETS: usize = 2100;

/// A weighted histogram over log-spaced buckets (allocated on first use).
#[derive(Debug, Clone, Default)]
pub struct LogHistogram {
    counts: Vec<u64>,
    total: u64,
}

impl LogHistogram {
    fn bucket(v: f64) -> usize {
        if v <= BASE {
            0
        } else {
            ((v / BASE).ln() / RATIO.ln())
                .ceil()
                .min((BUCKETS - 1) as f64) as usize
        }
    }

    /// Adds `weight` samples of value `v`.
    pub fn add(&mut self, v: f64, weight: u64) {
        if weight == 0 || !v.is_finite() {
            return;
        }
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
        }
        self.counts[Self::bucket(v)] += weight;
        self.total += weight;
    }

    /// Adds every sample of `other`.
    pub fn merge(&mut self, other: &Self) {
        if other.total == 0 {
            return;
        }
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS];
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// Samples added.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The `q`-quantile: the upper edge of the bucket holding the nearest-rank sample.
    #[must_use]
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(BASE * RATIO.powi(i as i32));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_and_bucketed_quantiles_agree_within_a_bucket() {
        let mut v: Vec<f64> = (1..=1000).map(|i| f64::from(i) * 1e-3).collect();
        let mut h = LogHistogram::default();
        for &x in &v {
            h.add(x, 1);
        }
        let exact = quantile(&mut v, 0.9).unwrap();
        assert_eq!(exact, 0.9);
        let b = h.quantile(0.9).unwrap();
        assert!(b >= exact && b <= exact * RATIO, "{b}");
        assert_eq!(quantile(&mut [], 0.9), None);
        assert_eq!(LogHistogram::default().quantile(0.9), None);
    }

    #[test]
    fn weights_count_as_repeated_samples() {
        let mut h = LogHistogram::default();
        h.add(0.01, 89);
        h.add(0.1, 11);
        // 89 % of the tokens at 10 ms: the p90 is the slow step.
        assert!(h.quantile(0.9).unwrap() >= 0.1);
        let mut h2 = LogHistogram::default();
        h2.add(0.01, 91);
        h2.add(0.1, 9);
        assert!(h2.quantile(0.9).unwrap() < 0.0102);
        h.merge(&h2);
        assert_eq!(h.total(), 200);
    }
}
