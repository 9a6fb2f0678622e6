//! SplitMix64 (Steele, Lea & Flood 2014), the one implementation in the workspace: the prefix
//! cache derives its second hash key from the seed with it, and the simulator
//! (`pagedkv-sim`) builds its seeded generator and synthetic token ids on it.
//!
//! ```
//! let mut state = 0u64;
//! assert_eq!(pagedkv::splitmix64::next(&mut state), 0xE220_A839_7B1D_CDAF);
//! assert_eq!(state, pagedkv::splitmix64::GAMMA);
//! ```

/// The increment of the generator's state: 2^64 divided by the golden ratio, rounded to odd.
pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Advances `state` by [`GAMMA`] and returns the next 64 output bits.
#[inline]
pub fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GAMMA);
    mix(*state)
}

/// The output function: a bijective 64-bit mix (Stafford's variant 13 of the MurmurHash3
/// finaliser), usable on its own to scramble keys. Not cryptographic.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
