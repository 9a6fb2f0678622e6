//! SipHash-1-3 with 128-bit output over whole little-endian `u64` words.
//!
//! Why not the `siphasher` crate: block hashing feeds only whole words (the message encoding in
//! [`super::hash`] pads every part to 8 bytes), and the crate's `write_u64` goes through its
//! byte-buffering `write` (tail bookkeeping on every word). This word-only state does one
//! compression round per word and nothing else; measured with callgrind on prefix admission
//! (benches/README.md, Prefix admission). It computes exactly the standard function: the tests
//! compare it with the `siphasher` crate on the same bytes, and with golden values.

/// The SipHash state after `len_bytes` bytes of whole words.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sip13 {
    v0: u64,
    v1: u64,
    v2: u64,
    v3: u64,
    len_bytes: u64,
}

impl Sip13 {
    /// A fresh state keyed by `(k0, k1)`, in the 128-bit output mode.
    #[inline(always)]
    pub(crate) fn new(k0: u64, k1: u64) -> Self {
        Sip13 {
            v0: k0 ^ 0x736f_6d65_7073_6575,
            // 0xee: the 128-bit output variant's domain separation.
            v1: k1 ^ 0x646f_7261_6e64_6f6d ^ 0xee,
            v2: k0 ^ 0x6c79_6765_6e65_7261,
            v3: k1 ^ 0x7465_6462_7974_6573,
            len_bytes: 0,
        }
    }

    #[inline(always)]
    fn round(&mut self) {
        self.v0 = self.v0.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(13) ^ self.v0;
        self.v0 = self.v0.rotate_left(32);
        self.v2 = self.v2.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(16) ^ self.v2;
        self.v0 = self.v0.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(21) ^ self.v0;
        self.v2 = self.v2.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(17) ^ self.v2;
        self.v2 = self.v2.rotate_left(32);
    }

    /// Absorbs one little-endian word (one compression round: the "1" of 1-3).
    #[inline(always)]
    pub(crate) fn word(&mut self, m: u64) {
        self.v3 ^= m;
        self.round();
        self.v0 ^= m;
        self.len_bytes += 8;
    }

    /// The 128-bit digest (three finalization rounds per half: the "3" of 1-3), low half
    /// first, as `siphasher`'s `Hash128::as_u128` orders it.
    #[inline(always)]
    pub(crate) fn finish128(mut self) -> u128 {
        // The message is whole words, so the last block is only the length byte.
        let b = (self.len_bytes & 0xff) << 56;
        self.v3 ^= b;
        self.round();
        self.v0 ^= b;
        self.v2 ^= 0xee;
        self.round();
        self.round();
        self.round();
        let h1 = self.v0 ^ self.v1 ^ self.v2 ^ self.v3;
        self.v1 ^= 0xdd;
        self.round();
        self.round();
        self.round();
        let h2 = self.v0 ^ self.v1 ^ self.v2 ^ self.v3;
        u128::from(h1) | u128::from(h2) << 64
    }
}
