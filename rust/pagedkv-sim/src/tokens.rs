//! Deterministic synthetic token ids, so prefix caching sees the same ids for the same text.
//!
//! A prompt position inside a request's shared prefix gets an id derived from the prefix id
//! alone (every request with that prefix agrees); a position covered by one of the request's
//! trace prefix blocks gets that block's token ([`crate::PrefixBlocks`]); any other prompt
//! position, and every generated position, gets an id derived from the request (and the
//! sequence in its group), so it matches nothing else. A preempted request recomputed later
//! re-derives the very same ids and can hit its own cached blocks, as in vLLM.

use std::sync::Arc;

use pagedkv::splitmix64;
use pagedkv::TokenId;

use crate::prefix_blocks::PrefixBlocks;
use crate::workload::{RequestSpec, Workload};

const PREFIX_DOMAIN: u64 = 0x5052_4546_4958_0001;
const PROMPT_DOMAIN: u64 = 0x5052_4f4d_5054_0002;
const OUTPUT_DOMAIN: u64 = 0x4f55_5450_5554_0003;

fn derive(domain: u64, id: u64, member: u64, position: usize) -> TokenId {
    let key = splitmix64::mix(splitmix64::mix(domain ^ id) ^ member.rotate_left(32));
    (splitmix64::mix(key ^ position as u64) >> 32) as TokenId
}

/// Token id at `position` (< prompt length) of request `request`'s prompt.
pub(crate) fn prompt_token(spec: &RequestSpec, request: usize, position: usize) -> TokenId {
    match spec.prefix {
        Some((prefix_id, prefix_len)) if position < prefix_len => {
            derive(PREFIX_DOMAIN, prefix_id, 0, position)
        }
        _ => derive(PROMPT_DOMAIN, request as u64, 0, position),
    }
}

/// The prompt tokens of a workload's requests: [`prompt_token`], or a request's trace prefix
/// blocks where they cover the position.
#[derive(Debug, Clone, Default)]
pub(crate) struct PromptSource {
    blocks: Option<Arc<PrefixBlocks>>,
}

impl PromptSource {
    pub fn new(workload: &Workload) -> Self {
        PromptSource {
            blocks: workload.prefix_blocks_arc(),
        }
    }

    /// Appends the token ids at positions `from..to` of request `request`'s prompt to `out`.
    pub fn extend(
        &self,
        spec: &RequestSpec,
        request: usize,
        from: usize,
        to: usize,
        out: &mut Vec<TokenId>,
    ) {
        match self.blocks.as_deref() {
            Some(b) => {
                let ids = b.of(request);
                out.extend((from..to).map(|pos| {
                    b.token(ids, pos)
                        .unwrap_or_else(|| prompt_token(spec, request, pos))
                }));
            }
            None => out.extend((from..to).map(|pos| prompt_token(spec, request, pos))),
        }
    }
}

/// Token id that sequence `member` of request `request` generates at `position`
/// (>= the prompt length).
pub(crate) fn output_token(request: usize, member: usize, position: usize) -> TokenId {
    derive(OUTPUT_DOMAIN, request as u64, member as u64, position)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(prefix: Option<(u64, usize)>) -> RequestSpec {
        RequestSpec {
            prompt_tokens: 8,
            output_tokens: 1,
            arrival_s: 0.0,
            group_size: 1,
            prefix,
        }
    }

    #[test]
    fn shared_prefix_agrees_and_suffixes_differ() {
        let a = spec(Some((3, 4)));
        let b = spec(Some((3, 4)));
        let c = spec(Some((4, 4)));
        for pos in 0..4 {
            assert_eq!(prompt_token(&a, 0, pos), prompt_token(&b, 1, pos));
        }
        let row =
            |s: &RequestSpec, r: usize| (0..8).map(|p| prompt_token(s, r, p)).collect::<Vec<_>>();
        assert_ne!(row(&a, 0)[4..], row(&b, 1)[4..]);
        assert_ne!(row(&a, 0)[..4], row(&c, 2)[..4]);
        assert_ne!(output_token(0, 0, 8), output_token(0, 1, 8));
        assert_eq!(output_token(5, 2, 9), output_token(5, 2, 9));
    }
}
