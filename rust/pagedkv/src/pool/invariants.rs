//! The pool's invariant checks: one that runs while other threads use the pool (a stable walk
//! of the free stack, retried while the head moves) and the exact quiescent one. Kept apart from
//! the lock-free operations they check; they read the same private fields.

use super::handle::refcount_of;
use super::tagged_head::{head_index, NIL};
use super::BlockPool;
use crate::error::{Error, Result};
use crate::sync::{spin_hint, Ordering};

impl BlockPool {
    /// Checks the free list while other threads may be using the pool: every block on the
    /// stack appears once and has refcount 0, the stack is acyclic and no longer than the pool,
    /// and `free_count <= stack length`. It walks the stack between two reads of the tagged
    /// head; if the head moved (a push or pop happened meanwhile) it retries, and after several
    /// contended attempts it settles for the counter bounds. Exact equalities that only hold
    /// when nobody is mid-operation are in [`BlockPool::check_invariants_quiescent`].
    ///
    /// ```
    /// let pool = pagedkv::BlockPool::new(4, 16)?;
    /// pool.check_invariants()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn check_invariants(&self) -> Result<()> {
        for _attempt in 0..16 {
            if let Some(walk) = self.stable_walk()? {
                if walk.free_count > walk.stack_len {
                    return Err(Error::InvariantViolation(format!(
                        "free_count {} exceeds free-list length {}",
                        walk.free_count, walk.stack_len
                    )));
                }
                return Ok(());
            }
            spin_hint();
        }
        self.check_counter_bounds()
    }

    /// The exact pool invariants, valid only while no other thread is inside a pool operation:
    /// everything [`BlockPool::check_invariants`] checks, plus free-list length ==
    /// `num_free_list_blocks()`, and the refcount-0 blocks are exactly the free ones plus the
    /// cached-evictable ones (in use + cached + free == num_blocks).
    ///
    /// ```
    /// let pool = pagedkv::BlockPool::new(4, 16)?;
    /// let b = pool.allocate(2)?;
    /// pool.check_invariants_quiescent()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn check_invariants_quiescent(&self) -> Result<()> {
        let walk = self.stable_walk()?.ok_or_else(|| {
            Error::InvariantViolation("free list changed during a quiescent check".into())
        })?;
        if walk.stack_len != walk.free_count {
            return Err(Error::InvariantViolation(format!(
                "free-list length {} != free_count {}",
                walk.stack_len, walk.free_count
            )));
        }
        let zero = self
            .refs
            .iter()
            .filter(|r| refcount_of(r.load(Ordering::Acquire)) == 0)
            .count();
        let cached = self.cached_count.load(Ordering::Acquire);
        if zero != walk.stack_len + cached {
            return Err(Error::InvariantViolation(format!(
                "{zero} blocks have refcount 0 but {} are free and {cached} cached",
                walk.stack_len
            )));
        }
        Ok(())
    }

    /// Walks the free stack; `None` if the head moved during the walk (snapshot not stable).
    fn stable_walk(&self) -> Result<Option<Walk>> {
        let head_before = self.head.load(Ordering::Acquire);
        let free_count = self.free_count.load(Ordering::Acquire);
        let mut seen = vec![false; self.num_blocks];
        let mut stack_len = 0usize;
        let mut index = head_index(head_before);
        let mut problem: Option<String> = None;
        while index != NIL {
            let i = index as usize;
            if i >= self.num_blocks {
                problem = Some(format!("free list links to out-of-range block {index}"));
                break;
            }
            if seen[i] {
                problem = Some(format!(
                    "block {index} is on the free list twice (or a cycle)"
                ));
                break;
            }
            seen[i] = true;
            stack_len += 1;
            let rc = refcount_of(self.refs[i].load(Ordering::Acquire));
            if rc != 0 {
                problem = Some(format!(
                    "block {index} is on the free list with refcount {rc}"
                ));
                break;
            }
            index = self.next[i].load(Ordering::Acquire);
        }
        if self.head.load(Ordering::Acquire) != head_before {
            return Ok(None);
        }
        match problem {
            Some(msg) => Err(Error::InvariantViolation(msg)),
            None => Ok(Some(Walk {
                stack_len,
                free_count,
            })),
        }
    }

    fn check_counter_bounds(&self) -> Result<()> {
        let free = self.free_count.load(Ordering::Acquire);
        let cached = self.cached_count.load(Ordering::Acquire);
        if free > self.num_blocks || cached > self.num_blocks {
            return Err(Error::InvariantViolation(format!(
                "free_count {free} / cached_count {cached} exceed num_blocks {}",
                self.num_blocks
            )));
        }
        Ok(())
    }
}

struct Walk {
    stack_len: usize,
    free_count: usize,
}
