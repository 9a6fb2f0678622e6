//! A state group's admission with a connector's external computed tokens
//! (manager/state_external.rs; docs/design.md, KV groups, "State groups"): vLLM's blocks, one
//! at the last external token and one at the chunk's end, and vLLM's count, which counts the
//! hit's cached-evictable state block although the admission never takes it. The same cases
//! run against vLLM's own manager in tests/vllm/test_vllm_mamba_connector.py.

use pagedkv::{
    AdmitOptions, Error, KvCacheManager, KvGroupSpec, ManagerConfig, Prompt, NULL_BLOCK,
};

const BS: usize = 2;

/// A manager of `num_blocks` on which `[1, 2, 3, 4]` was computed two tokens per step and
/// freed: full attention's two blocks and the state block at token 4 cached-evictable.
fn seeded(num_blocks: usize) -> KvCacheManager {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks,
        block_size: BS,
        enable_prefix_caching: true,
        kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState],
        ..Default::default()
    })
    .unwrap();
    kv.new_step();
    let first = AdmitOptions {
        reserve_prompt: false,
        num_scheduled: 2,
        ..Default::default()
    };
    kv.add_sequence_with(1, Prompt::Tokens(&[1, 2, 3, 4]), &first)
        .unwrap();
    kv.new_step();
    assert!(kv.allocate_slots(1, 2, 0).unwrap());
    kv.free(1).unwrap();
    kv.new_step();
    kv.check_invariants().unwrap();
    kv
}

fn with_external(num_scheduled: usize, external: usize) -> AdmitOptions<'static> {
    AdmitOptions {
        reserve_prompt: false,
        require_full_prompt: false,
        num_scheduled,
        num_external_computed_tokens: external,
        ..Default::default()
    }
}

/// A chunk ending in the external tokens' block: the state group takes that one block, yet
/// vLLM counts one new block plus the hit's evictable state block, so with 4 blocks available
/// (the allocation's 1 + 2 revived + 1) the admission is refused as vLLM refuses it; with 5 it
/// is admitted, the hit's state block left cached, not taken.
#[test]
fn the_hits_evictable_state_block_is_counted_not_taken() {
    let prompt = [1, 2, 3, 4, 5, 6];
    let mut kv = seeded(4);
    assert_eq!(kv.num_available_blocks(), 4);
    match kv.add_sequence_with(2, Prompt::Tokens(&prompt), &with_external(1, 1)) {
        Err(Error::OutOfBlocks {
            needed_blocks: 5,
            available_blocks: 4,
            ..
        }) => {}
        other => panic!("expected vLLM's refusal, got {other:?}"),
    }
    kv.check_invariants().unwrap();
    assert_eq!(kv.num_available_blocks(), 4);

    let mut kv = seeded(5);
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &with_external(1, 1))
            .unwrap(),
        4
    );
    let state = kv.block_table_group(2, 1).unwrap();
    assert_eq!(state[..2], [NULL_BLOCK, NULL_BLOCK]);
    assert_ne!(state[2], NULL_BLOCK);
    assert_eq!(kv.block_table_group(2, 0).unwrap().len(), 3);
    kv.check_invariants().unwrap();
}

/// A chunk ending a block past the external tokens': one block at the last external token
/// (the state the connector restores), nulls, one at the chunk's end; when vLLM's count (one
/// new block, no evictable state block: the prompt shares nothing) passes and the pool cannot
/// give the two, the admission is `OutOfBlocks` and changes nothing.
#[test]
fn external_tokens_take_a_state_block_and_the_chunk_another() {
    let prompt: Vec<u32> = (100..110).collect();
    let mut kv = seeded(8);
    assert_eq!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &with_external(7, 3))
            .unwrap(),
        0
    );
    let state = kv.block_table_group(2, 1).unwrap();
    let live: Vec<usize> = (0..state.len())
        .filter(|&i| state[i] != NULL_BLOCK)
        .collect();
    assert_eq!((state.len(), live), (4, vec![1, 3]));
    kv.check_invariants().unwrap();

    // Full attention's 4 blocks and vLLM's one state block fit 5 available; the two state
    // blocks do not.
    let mut kv = seeded(5);
    let before = kv.num_available_blocks();
    assert!(matches!(
        kv.add_sequence_with(2, Prompt::Tokens(&prompt), &with_external(7, 3)),
        Err(Error::OutOfBlocks {
            needed_blocks: 6,
            available_blocks: 5,
            ..
        })
    ));
    assert_eq!(kv.num_available_blocks(), before);
    kv.check_invariants().unwrap();
}

/// Without prefix caching too (the pool's own refusal of more than it holds would be
/// `InvalidArgument`): vLLM's count (3 + 1) passes 4 blocks, the allocation (3 + 2) does not,
/// so `OutOfBlocks`, nothing changed (the case the model test found).
#[test]
fn without_caching_the_allocation_past_the_pool_is_out_of_blocks() {
    let mut kv = KvCacheManager::new(ManagerConfig {
        num_blocks: 4,
        block_size: 4,
        enable_prefix_caching: false,
        kv_groups: vec![KvGroupSpec::FullAttention, KvGroupSpec::MambaState],
        ..Default::default()
    })
    .unwrap();
    assert!(matches!(
        kv.add_sequence_with(0, Prompt::Len(9), &with_external(9, 1)),
        Err(Error::OutOfBlocks {
            needed_blocks: 5,
            available_blocks: 4,
            ..
        })
    ));
    assert_eq!(kv.num_available_blocks(), 4);
    kv.check_invariants().unwrap();
}
