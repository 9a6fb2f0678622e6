//! The group policies of the reference model (docs/design.md, KV groups), as plain functions
//! of a group's spec: which leading blocks a sliding window releases, which positions a prefix
//! hit needs cached in each group (and so the longest hit every group serves), whether a
//! group's blocks enter the index, a window group's admission cap under the manager's
//! [`Limits`], and which new positions a state group allocates (the last of a chunk's). A leaf: the model (`reference.rs`, `window.rs`) applies these to its tables.

use pagedkv::KvGroupSpec;

/// Admission limits of the manager under test.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_model_len: usize,
    pub max_in_flight: usize,
    pub watermark: usize,
}

/// `cdiv(window - 1, bs)`: blocks a window's hit needs before its end.
fn need(window: usize, bs: usize) -> usize {
    (window - 1).div_ceil(bs)
}

/// Leading blocks a group releases at `processed` tokens.
pub fn skipped(spec: KvGroupSpec, processed: usize, bs: usize) -> usize {
    match spec {
        KvGroupSpec::FullAttention => 0,
        KvGroupSpec::SlidingWindow { window } => processed.saturating_sub(window - 1) / bs,
        // Only the state at the last processed token is read next.
        KvGroupSpec::MambaState => processed.saturating_sub(1) / bs,
    }
}

/// Blocks one allocation gives a group at most (a state group: one, at the chunk's end).
pub fn fresh_cap(spec: KvGroupSpec) -> Option<usize> {
    match spec {
        KvGroupSpec::MambaState => Some(1),
        _ => None,
    }
}

/// Grows a group's table to `end` positions in one allocation: a state group's new positions
/// are null but the last, which takes a block from `supply`; the others' all take one.
pub fn grow<T>(
    spec: KvGroupSpec,
    table: &mut Vec<Option<T>>,
    end: usize,
    supply: &mut impl Iterator<Item = T>,
) {
    if table.len() >= end {
        return;
    }
    if spec == KvGroupSpec::MambaState {
        table.resize_with(end - 1, || None);
    }
    while table.len() < end {
        table.push(Some(supply.next().unwrap()));
    }
}

/// What a sequence of `positions` positions needs the pool to hold at least: its positions
/// when a state group is among the groups (its table is that long), else 0.
pub fn table_bound(specs: &[KvGroupSpec], positions: usize) -> usize {
    if specs.contains(&KvGroupSpec::MambaState) {
        positions
    } else {
        0
    }
}

/// Fresh blocks over every group when the tables grow from `first` to `end` positions.
pub fn fresh_for(specs: &[KvGroupSpec], first: usize, end: usize) -> usize {
    let n = end.saturating_sub(first);
    specs
        .iter()
        .map(|&s| fresh_cap(s).map_or(n, |c| c.min(n)))
        .fold(0usize, usize::saturating_add)
}

/// The longest hit of at most `max` blocks every group serves (declarative: each group has
/// every block a hit of that length needs), given which blocks each group has cached.
pub fn hit_len(
    specs: &[KvGroupSpec],
    bs: usize,
    max: usize,
    cached: impl Fn(usize, usize) -> bool,
) -> usize {
    let serves = |l: usize| {
        l == 0
            || specs
                .iter()
                .enumerate()
                .all(|(g, &spec)| needed(spec, l, bs).all(|i| cached(g, i)))
    };
    (0..=max).rev().find(|&l| serves(l)).unwrap_or(0)
}

/// Whether a group's blocks enter the index (not a window of one token).
pub fn caches(spec: KvGroupSpec, bs: usize) -> bool {
    match spec {
        KvGroupSpec::FullAttention => true,
        KvGroupSpec::SlidingWindow { window } => need(window, bs) > 0,
        KvGroupSpec::MambaState => true,
    }
}

/// Positions a hit of `l` blocks needs cached in a group (declarative).
pub fn needed(spec: KvGroupSpec, l: usize, bs: usize) -> std::ops::Range<usize> {
    match spec {
        KvGroupSpec::FullAttention => 0..l,
        KvGroupSpec::SlidingWindow { window } => {
            let n = need(window, bs).max(1);
            l.saturating_sub(n)..l
        }
        // The state block at the hit's end, alone.
        KvGroupSpec::MambaState => l.saturating_sub(1)..l,
    }
}

/// A window group's admission cap in blocks (`None`: full attention).
pub fn cap(spec: KvGroupSpec, bs: usize, limits: Limits) -> Option<usize> {
    match spec {
        KvGroupSpec::FullAttention | KvGroupSpec::MambaState => None,
        KvGroupSpec::SlidingWindow { window } => Some(
            ((window - 1).saturating_add(limits.max_in_flight))
                .min(limits.max_model_len)
                .div_ceil(bs)
                .saturating_add(1),
        ),
    }
}
