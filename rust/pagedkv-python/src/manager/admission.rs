//! Admission and prefix calls of `pagedkv.KvCacheManager`: `add_sequence` (whole-prompt or per-chunk,
//! docs/embedding.md), `match_prefix`, `pin_prefix` / `unpin_prefix`, `blocks_needed_for_prompt`.
//! Argument conversion and error mapping only, as in `manager/mod.rs`.

use pyo3::prelude::*;

use pagedkv::{AdmitOptions, PrefillCheckpoint, Prompt};

use crate::block_keys::BlockKeyArgs;
use crate::errors::invalid_argument;
use crate::prompt_hashes::{hashes_arg, HashesArg};
use crate::scalars::{CountArg, ExtraKey, FlagArg, SeqIdArg};

use super::{check_token_count, PyKvCacheManager, DETACH_MIN_PROMPT_TOKENS};

#[pymethods]
impl PyKvCacheManager {
    /// Admits a prompt; returns the number of its tokens served from the prefix cache.
    ///
    /// `token_ids`: `[num_tokens]` ints (list/tuple/range or 1-D integer array), or pass only
    /// `num_tokens` (such a prompt is never hashed). `extra_key` (str | bytes | int) isolates
    /// prefix-cache namespaces (cache salt, adapter id). `num_scheduled`: how many of the new
    /// (non-hit) tokens the next pass computes (chunked prefill; `None` = all).
    /// `reserve_prompt=False` takes blocks for the hit and the scheduled tokens only (vLLM's
    /// per-chunk contract: `allocate_slots` each later step) after vLLM's whole-prompt
    /// admission check, or, with `require_full_prompt=False` (vLLM's
    /// `full_sequence_must_fit=False`), after checking the scheduled chunk only;
    /// `num_lookahead_tokens` adds
    /// speculative slots; `block_extra_keys` / `block_hashes` are the caller's per-block keys
    /// and chained hashes (another engine's names); `prompt_hashes` are pagedkv's own hashes of
    /// the prompt computed earlier (`prompt_hashes(tokens)`, a `PromptHashes`, or a list of
    /// ints as `prefix_block_hashes` returns them), read instead of hashing the prompt again;
    /// `apply_watermark` applies `watermark_blocks`; `reserved_blocks` must stay available
    /// besides it (vLLM's `reserved_blocks`: in-flight async KV loads);
    /// `num_external_computed_tokens` of the scheduled tokens are computed elsewhere (a KV
    /// connector's, per-chunk only): window groups release what their windows leave at the hit
    /// plus these before the admission is sized; `diverged_hit=True` takes the full-attention
    /// groups' own run as the hit (vLLM's diverged hit: with external tokens, per chunk, full
    /// attention and `MambaState` groups only; else `InvalidArgumentError`);
    /// `prefill_checkpoint=(prefill_end, alignment)` gives `MambaState` groups vLLM's prefill
    /// check-point blocks (per chunk, no external tokens; `pagedkv.PrefillCheckpoint` in Rust).
    #[pyo3(signature = (
        seq_id, token_ids=None, *, num_tokens=None, extra_key=None, num_scheduled=None,
        reserve_prompt=FlagArg(true), require_full_prompt=FlagArg(true),
        num_lookahead_tokens=CountArg(0), block_extra_keys=None, block_hashes=None,
        apply_watermark=FlagArg(true), prompt_hashes=None, reserved_blocks=CountArg(0),
        num_external_computed_tokens=CountArg(0), diverged_hit=FlagArg(false),
        prefill_checkpoint=None
    ))]
    #[pyo3(
        text_signature = "(self, seq_id, token_ids=None, *, num_tokens=None, extra_key=None, \
        num_scheduled=None, reserve_prompt=True, require_full_prompt=True, \
        num_lookahead_tokens=0, block_extra_keys=None, block_hashes=None, apply_watermark=True, \
        prompt_hashes=None, reserved_blocks=0, num_external_computed_tokens=0, \
        diverged_hit=False, prefill_checkpoint=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn add_sequence(
        &self,
        py: Python<'_>,
        seq_id: SeqIdArg,
        token_ids: Option<Bound<'_, PyAny>>,
        num_tokens: Option<CountArg>,
        extra_key: Option<ExtraKey>,
        num_scheduled: Option<CountArg>,
        reserve_prompt: FlagArg,
        require_full_prompt: FlagArg,
        num_lookahead_tokens: CountArg,
        block_extra_keys: Option<Bound<'_, PyAny>>,
        block_hashes: Option<Bound<'_, PyAny>>,
        apply_watermark: FlagArg,
        prompt_hashes: Option<Bound<'_, PyAny>>,
        reserved_blocks: CountArg,
        num_external_computed_tokens: CountArg,
        diverged_hit: FlagArg,
        prefill_checkpoint: Option<(CountArg, CountArg)>,
    ) -> PyResult<usize> {
        let scheduled = num_scheduled.map_or(usize::MAX, |n| n.0);
        let plain = reserve_prompt.0
            && num_lookahead_tokens.0 == 0
            && block_extra_keys.is_none()
            && block_hashes.is_none()
            && prompt_hashes.is_none()
            && apply_watermark.0
            && reserved_blocks.0 == 0
            && num_external_computed_tokens.0 == 0
            && !diverged_hit.0
            && prefill_checkpoint.is_none();
        if !plain {
            let max_tokens = self.max_prompt_tokens(!reserve_prompt.0 && !require_full_prompt.0);
            let keys = BlockKeyArgs::extract(
                py,
                block_extra_keys.as_ref(),
                block_hashes.as_ref(),
                max_tokens.div_ceil(self.block_size).max(self.num_blocks),
            )?;
            let given = prompt_hashes
                .as_ref()
                .map(|h| hashes_arg(h, "prompt_hashes", max_tokens / self.block_size))
                .transpose()?;
            let token_ids = token_ids
                .map(|t| self.token_ids_bounded(&t, max_tokens))
                .transpose()?;
            let prompt = match &token_ids {
                Some(t) => {
                    let t = t.as_slice()?;
                    check_token_count(py, t.len(), num_tokens)?;
                    Prompt::Tokens(t)
                }
                None if extra_key.is_some() => return Err(invalid_argument(
                    py,
                    "extra_key needs token_ids: a prompt given only as num_tokens is never hashed"
                        .to_owned(),
                )),
                None => Prompt::Len(num_tokens.map_or(0, |n| n.0)),
            };
            let key = extra_key.as_ref().map(|key| key.0.as_slice());
            let extra_keys = keys.extra_keys();
            let heavy = prompt.len() >= DETACH_MIN_PROMPT_TOKENS;
            return self.run(py, heavy, |kv| {
                let options = AdmitOptions {
                    extra_key: key,
                    num_scheduled: scheduled,
                    reserve_prompt: reserve_prompt.0,
                    require_full_prompt: require_full_prompt.0,
                    num_lookahead_tokens: num_lookahead_tokens.0,
                    block_extra_keys: extra_keys.as_deref(),
                    block_hashes: keys.hashes.as_deref(),
                    prompt_hashes: given.as_ref().map(HashesArg::as_slice),
                    apply_watermark: apply_watermark.0,
                    reserved_blocks: reserved_blocks.0,
                    num_external_computed_tokens: num_external_computed_tokens.0,
                    diverged_hit: diverged_hit.0,
                    prefill_checkpoint: prefill_checkpoint.map(|(end, alignment)| {
                        PrefillCheckpoint {
                            prefill_end: end.0,
                            alignment: alignment.0,
                        }
                    }),
                };
                kv.add_sequence_with(seq_id.0, prompt, &options)
            });
        }
        match token_ids {
            Some(token_ids) => {
                let token_ids = self.token_ids(&token_ids)?;
                let ids = token_ids.as_slice()?;
                check_token_count(py, ids.len(), num_tokens)?;
                let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
                let key = extra_key.as_ref().map(|key| key.0.as_slice());
                self.run(py, heavy, |kv| {
                    kv.add_sequence_scheduled(seq_id.0, ids, key, scheduled)
                })
            }
            None => {
                if extra_key.is_some() {
                    return Err(invalid_argument(
                        py,
                        "extra_key needs token_ids: a prompt given only as num_tokens is never hashed"
                            .to_owned(),
                    ));
                }
                let count = num_tokens.map_or(0, |n| n.0);
                self.run(py, false, |kv| {
                    kv.add_sequence_len_scheduled(seq_id.0, count, scheduled)
                })
            }
        }
    }

    /// The hit `add_sequence` would return for `tokens` now (with the same `extra_key`,
    /// `block_extra_keys`, `block_hashes` and `prompt_hashes`); changes nothing.
    #[pyo3(signature = (
        tokens, *, extra_key=None, block_extra_keys=None, block_hashes=None, prompt_hashes=None
    ))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        tokens: Bound<'_, PyAny>,
        extra_key: Option<ExtraKey>,
        block_extra_keys: Option<Bound<'_, PyAny>>,
        block_hashes: Option<Bound<'_, PyAny>>,
        prompt_hashes: Option<Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let token_ids = self.token_ids(&tokens)?;
        let ids = token_ids.as_slice()?;
        let key = extra_key.as_ref().map(|key| key.0.as_slice());
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        if block_extra_keys.is_none() && block_hashes.is_none() && prompt_hashes.is_none() {
            return self.run(py, heavy, |kv| kv.match_prefix(ids, key));
        }
        let keys = BlockKeyArgs::extract(
            py,
            block_extra_keys.as_ref(),
            block_hashes.as_ref(),
            self.num_blocks,
        )?;
        let given = prompt_hashes
            .as_ref()
            .map(|h| hashes_arg(h, "prompt_hashes", ids.len() / self.block_size))
            .transpose()?;
        let extra_keys = keys.extra_keys();
        self.run(py, heavy, |kv| {
            let options = AdmitOptions {
                extra_key: key,
                block_extra_keys: extra_keys.as_deref(),
                block_hashes: keys.hashes.as_deref(),
                prompt_hashes: given.as_ref().map(HashesArg::as_slice),
                ..AdmitOptions::default()
            };
            kv.match_prefix_with(ids, &options)
        })
    }

    /// Pins the cached blocks of the longest cached prefix of `tokens`; returns the tokens
    /// pinned (0: nothing pinned, no pin recorded).
    #[pyo3(signature = (tokens, *, extra_key=None))]
    fn pin_prefix(
        &self,
        py: Python<'_>,
        tokens: Bound<'_, PyAny>,
        extra_key: Option<ExtraKey>,
    ) -> PyResult<usize> {
        let token_ids = self.token_ids(&tokens)?;
        let ids = token_ids.as_slice()?;
        let key = extra_key.as_ref().map(|key| key.0.as_slice());
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        self.run(py, heavy, |kv| kv.pin_prefix(ids, key))
    }

    /// Releases the most recent pin of `tokens`; `InvalidArgumentError` when there is none.
    #[pyo3(signature = (tokens, *, extra_key=None))]
    fn unpin_prefix(
        &self,
        py: Python<'_>,
        tokens: Bound<'_, PyAny>,
        extra_key: Option<ExtraKey>,
    ) -> PyResult<()> {
        let token_ids = self.token_ids(&tokens)?;
        let ids = token_ids.as_slice()?;
        let key = extra_key.as_ref().map(|key| key.0.as_slice());
        let heavy = ids.len() >= DETACH_MIN_PROMPT_TOKENS;
        self.run(py, heavy, |kv| kv.unpin_prefix(ids, key))
    }

    /// Blocks a prompt of `num_tokens` tokens needs, ignoring prefix-cache hits.
    fn blocks_needed_for_prompt(&self, py: Python<'_>, num_tokens: CountArg) -> PyResult<usize> {
        self.read(py, |kv| kv.blocks_needed_for_prompt(num_tokens.0))
    }
}
