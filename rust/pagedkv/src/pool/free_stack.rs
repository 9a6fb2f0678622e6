//! The lock-free free stack: reservations against the free count, pops of reserved blocks and
//! pushes of freed ones (the module documentation of `pool` says why a tagged-index Treiber
//! stack with a reserve-first counter).

use super::cas::{cas_retry, Cas};
use super::tagged_head::{head_index, head_tag, pack, NIL};
use super::BlockPool;
use crate::sync::{spin_hint, Backoff, Ordering};
use crate::types::BlockId;

impl BlockPool {
    /// Reserves exactly `n` free blocks, or returns the free count seen when it could not.
    #[inline]
    pub(super) fn reserve_exact(&self, n: usize) -> std::result::Result<(), usize> {
        cas_retry(
            &*self.free_count,
            Ordering::Acquire,
            Ordering::AcqRel,
            |cur| {
                if cur < n {
                    Cas::Stop(Err(cur))
                } else {
                    Cas::Swap(cur - n, Ok(()))
                }
            },
        )
    }

    /// Pops `n` blocks (each refcount 0 -> 1), appending them to `out` top first; the caller
    /// holds a reservation of `n`, so the stack holds them.
    ///
    /// Uncontended, one walk of `n` links and one update of the head take them all. The walk
    /// sits between reading the head and the CAS, so under contention any concurrent push or
    /// pop fails a long walk, and retrying the same walk can lose again and again (a 512-block
    /// allocation against one churning thread waited milliseconds). So after each failed CAS
    /// the chunk halves (down to single pops, whose window is as short as a push's) and after
    /// each success it doubles back. Taking the blocks in several pops is still
    /// all-or-nothing for the caller: the reservation already guarantees every pop succeeds.
    ///
    /// A walk reads a consistent chain whenever its CAS succeeds: an unchanged tag means no
    /// push or pop happened since the head was read, and a link of a block is only written
    /// while the block is off the stack. (The one CAS loop not written with [`cas_retry`]: a
    /// failure also shrinks the chunk and drops the walked ids, a success keeps its own head.)
    #[inline]
    pub(super) fn pop_reserved(&self, n: usize, out: &mut Vec<BlockId>) {
        if n == 1 {
            let b = self.pop_one_reserved();
            out.push(b);
            return;
        }
        out.reserve(n);
        let mut remaining = n;
        let mut chunk = n;
        let mut head = self.head.load(Ordering::Acquire);
        let mut backoff = Backoff::new();
        while remaining > 0 {
            let want = chunk.min(remaining);
            let start = out.len();
            let mut index = head_index(head);
            while out.len() - start < want && index != NIL {
                out.push(index);
                // A stale link (the block was popped and pushed again meanwhile) is harmless:
                // the tag moved, so the CAS below fails and we retry.
                index = self.next[index as usize].load(Ordering::Relaxed);
            }
            if out.len() - start < want {
                // A stale snapshot ran off the end of the stack (`stack length >= free_count +
                // reservations` holds for the current one): reread. Spinning rather than failing
                // half-way keeps the allocation all-or-nothing regardless.
                out.truncate(start);
                spin_hint();
                head = self.head.load(Ordering::Acquire);
                continue;
            }
            let new_head = pack(head_tag(head).wrapping_add(1), index);
            match self.head.compare_exchange_weak(
                head,
                new_head,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    for &b in &out[start..] {
                        self.start_tenancy(b);
                    }
                    remaining -= want;
                    chunk = chunk.saturating_mul(2);
                    // The contention that failed earlier CASes has passed: wait short again.
                    backoff = Backoff::new();
                    // Our own CAS installed it; if it moved since, the next CAS says so.
                    head = new_head;
                }
                Err(_) => {
                    out.truncate(start);
                    chunk = (chunk / 2).max(1);
                    backoff.snooze();
                    // Reload after the wait: the value the CAS saw is older than the spin.
                    head = self.head.load(Ordering::Acquire);
                }
            }
        }
    }

    /// [`BlockPool::pop_reserved`] of one block (the common case: a sequence crossing into a
    /// new block), without the buffer bookkeeping of the walk.
    #[inline]
    fn pop_one_reserved(&self) -> BlockId {
        let index = cas_retry(&*self.head, Ordering::Acquire, Ordering::AcqRel, |head| {
            let index = head_index(head);
            if index == NIL {
                // Unreachable while `stack length >= free_count + reservations` holds; spinning
                // (rather than failing half-way) keeps the allocation all-or-nothing regardless.
                debug_assert!(false, "free stack empty under a reservation");
                return Cas::Spin;
            }
            // A stale `next` (the block was popped and pushed again) is harmless: the tag moved,
            // so the CAS fails and we retry.
            let next = self.next[index as usize].load(Ordering::Relaxed);
            Cas::Swap(pack(head_tag(head).wrapping_add(1), next), index)
        });
        self.start_tenancy(index);
        index
    }

    /// Pushes a refcount-0 block on the free stack, then makes it allocatable.
    #[inline]
    pub(super) fn push_free(&self, block_id: BlockId) {
        self.push_chain(block_id, block_id, 1);
    }

    /// Pushes `count` refcount-0 blocks already linked from `top` down to `bottom` (through
    /// `next`) onto the free stack with one CAS, then makes them allocatable.
    #[inline]
    pub(super) fn push_chain(&self, top: BlockId, bottom: BlockId, count: usize) {
        cas_retry(&*self.head, Ordering::Relaxed, Ordering::AcqRel, |head| {
            // Release (like the refcount store on allocation): a concurrent checker that reads
            // this link or refcount also sees the pop that preceded it, so it notices the head
            // moved and discards its walk instead of reporting a torn snapshot.
            self.next[bottom as usize].store(head_index(head), Ordering::Release);
            Cas::Swap(pack(head_tag(head).wrapping_add(1), top), ())
        });
        // Only after the push: keeps `stack length >= free_count + reservations`.
        self.free_count.fetch_add(count, Ordering::AcqRel);
    }
}
