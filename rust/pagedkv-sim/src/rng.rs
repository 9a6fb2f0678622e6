//! A tiny seeded generator so that simulations are reproducible without extra dependencies.

use pagedkv::splitmix64;

/// SplitMix64 (Steele, Lea & Flood 2014; the one implementation is [`pagedkv::splitmix64`]):
/// 64 bits of state, passes BigCrush, fast and plenty for arrival gaps and beam choices, with
/// the distributions the simulator draws from. Not cryptographic.
///
/// ```
/// use pagedkv_sim::SplitMix64;
/// let mut a = SplitMix64::new(42);
/// let mut b = SplitMix64::new(42);
/// assert_eq!(a.next_u64(), b.next_u64());
/// let x = a.next_f64();
/// assert!((0.0..1.0).contains(&x));
/// ```
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        splitmix64::next(&mut self.state)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, bound)`; `bound` must be positive. (Multiply-shift: the bias is below
    /// 2^-32 for the small bounds used here.)
    pub fn next_below(&mut self, bound: u64) -> u64 {
        assert!(bound > 0, "next_below needs a positive bound");
        ((self.next_u64() as u128 * bound as u128) >> 64) as u64
    }

    /// Exponentially distributed with the given rate (mean `1 / rate`).
    pub fn next_exponential(&mut self, rate: f64) -> f64 {
        // 1 - U lies in (0, 1], so the logarithm is finite.
        -(1.0 - self.next_f64()).ln() / rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_mean_is_close_to_one_over_rate() {
        let mut rng = SplitMix64::new(1);
        let n = 200_000;
        let mean: f64 = (0..n).map(|_| rng.next_exponential(4.0)).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.005, "mean {mean}");
    }

    #[test]
    fn next_below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(3);
        let mut seen = [0usize; 7];
        for _ in 0..7000 {
            seen[rng.next_below(7) as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 800), "{seen:?}");
    }

    #[test]
    fn different_seeds_give_different_streams() {
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
    }
}
