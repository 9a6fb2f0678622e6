//! A request in flight: its sequences and how far they got.

use pagedkv::SeqId;

use crate::extent::Extent;
use crate::workload::RequestSpec;

/// One request's sequences, generated in lockstep (every sequence holds the same number of
/// tokens; a plain request is a group of one).
#[derive(Debug, Clone)]
pub(crate) struct Group {
    /// Index of the request in the workload.
    pub request: usize,
    pub spec: RequestSpec,
    /// Live sequence ids (`spec.group_size` of them while admitted; empty while waiting).
    pub members: Vec<SeqId>,
    /// Tokens each sequence has generated so far (kept across recompute preemption, where they
    /// become part of the recomputed prompt).
    pub generated: usize,
    /// Contiguous reservations, one per member (contiguous allocators only).
    pub extents: Vec<Extent>,
    /// Distinct device blocks the group gave up when swapped out (needed to swap it back in).
    pub swapped_blocks: usize,
}

impl Group {
    pub fn new(request: usize, spec: RequestSpec) -> Self {
        Group {
            request,
            spec,
            members: Vec::new(),
            generated: 0,
            extents: Vec::new(),
            swapped_blocks: 0,
        }
    }

    /// Tokens each sequence holds now.
    pub fn num_tokens(&self) -> usize {
        self.spec.prompt_tokens + self.generated
    }

    /// Tokens each sequence holds when finished.
    pub fn final_len(&self) -> usize {
        self.spec.final_len()
    }

    pub fn is_finished(&self) -> bool {
        self.generated >= self.spec.output_tokens
    }
}
