//! [`PoolPeers`]: managers sharing one [`crate::BlockPool`] reclaim each other's cached blocks.
//!
//! A manager with prefix caching keeps the blocks of freed sequences out of the pool's free
//! list as *cached-evictable*, and only it can evict them (its index and LRU are its own,
//! behind `&mut self`). On a shared pool that would let one manager's cache starve the others:
//! another manager short of blocks would get `OutOfBlocks` although nothing is in use anywhere,
//! and retrying would never help. The policy here closes that gap without touching the
//! lock-free allocation path:
//!
//! * every manager of the group lives behind its own `Mutex` (each engine thread already
//!   serializes its manager; the Python bindings hold one per manager anyway);
//! * a manager whose operation fails with a *device* `OutOfBlocks` drops its own lock, asks
//!   its peers in turn (each locked alone, so no lock order can deadlock) to release the
//!   shortfall from their LRU fronts to the pool's free list ([`KvCacheManager::evict_cached`]),
//!   and runs the operation once more. Operations are all-or-nothing, so the failed attempt
//!   changed nothing and the retry is a fresh start.
//!
//! The guarantee: when the blocks an operation needs exist as free or cached-evictable blocks
//! anywhere on the pool, and no other thread takes them meanwhile, the operation succeeds.
//! Peers give up their least recently used blocks first, but the order *across* peers is the
//! registration order, not one global LRU.

use std::sync::{Arc, Mutex, Weak};

use crate::error::{Error, Result, Tier};
use crate::manager::KvCacheManager;

/// The managers sharing one pool (weakly held: a dropped manager leaves the group).
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use pagedkv::{BlockPool, KvCacheManager, ManagerConfig, PoolPeers};
/// let pool = Arc::new(BlockPool::new(4, 2)?);
/// let cfg = ManagerConfig { enable_prefix_caching: true, ..Default::default() };
/// let peers = PoolPeers::default();
/// let a = Arc::new(Mutex::new(KvCacheManager::with_pool(pool.clone(), cfg.clone())?));
/// let b = Arc::new(Mutex::new(KvCacheManager::with_pool(pool.clone(), cfg)?));
/// peers.join(&a);
/// peers.join(&b);
/// peers.run(&a, |kv| kv.add_sequence(1, &[1, 2, 3, 4, 5, 6, 7, 8], None))?;
/// peers.run(&a, |kv| kv.free(1))?;                     // 4 blocks cached by `a`
/// peers.run(&b, |kv| kv.add_sequence_len(1, 8))?;      // reclaimed from `a`
/// assert_eq!(a.lock().unwrap().stats().num_cached_blocks, 0);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct PoolPeers {
    members: Mutex<Vec<Weak<Mutex<KvCacheManager>>>>,
}

impl PoolPeers {
    /// Adds `manager` to the group (it must allocate from the group's pool).
    pub fn join(&self, manager: &Arc<Mutex<KvCacheManager>>) {
        let mut members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        members.retain(|m| m.strong_count() > 0);
        members.push(Arc::downgrade(manager));
    }

    /// Members still alive.
    pub fn len(&self) -> usize {
        let members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        members.iter().filter(|m| m.strong_count() > 0).count()
    }

    /// Whether no member is alive.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Releases up to `blocks` cached blocks of the members other than `me` to the pool's
    /// free list (each peer's least recently used first). The caller must not hold any
    /// member's lock. A peer whose lock is poisoned is skipped. Returns the blocks released.
    pub fn reclaim(&self, me: &Arc<Mutex<KvCacheManager>>, blocks: usize) -> usize {
        let peers: Vec<Arc<Mutex<KvCacheManager>>> = {
            let members = self.members.lock().unwrap_or_else(|p| p.into_inner());
            members.iter().filter_map(Weak::upgrade).collect()
        };
        let mut released = 0;
        for peer in peers {
            if released >= blocks {
                break;
            }
            if Arc::ptr_eq(&peer, me) {
                continue;
            }
            if let Ok(mut kv) = peer.lock() {
                released += kv.evict_cached(blocks - released);
            }
        }
        released
    }

    /// Checks the pool's cached-block count exactly: with every member locked (in
    /// registration order, as no other caller locks two, so no lock order can deadlock), it
    /// must equal the sum of the members' caches, provided the members are all the managers
    /// the pool has (a manager outside the group could be mid-operation: then nothing is
    /// checked, as when a member's lock is poisoned). A member's own `check_invariants` checks
    /// the count only as a bound, since its peers run meanwhile. The caller must not hold any
    /// member's lock. Fails with [`Error::InvariantViolation`] when the counts differ or a
    /// member allocates from another pool than the first member's.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use pagedkv::{BlockPool, KvCacheManager, ManagerConfig, PoolPeers};
    /// let pool = Arc::new(BlockPool::new(8, 2)?);
    /// let cfg = ManagerConfig { enable_prefix_caching: true, ..Default::default() };
    /// let peers = PoolPeers::default();
    /// let a = Arc::new(Mutex::new(KvCacheManager::with_pool(pool.clone(), cfg.clone())?));
    /// let b = Arc::new(Mutex::new(KvCacheManager::with_pool(pool.clone(), cfg)?));
    /// peers.join(&a);
    /// peers.join(&b);
    /// peers.run(&a, |kv| kv.add_sequence(1, &[1, 2, 3, 4], None))?;
    /// peers.run(&a, |kv| kv.free(1))?;                     // 2 blocks cached by `a`
    /// assert_eq!(pool.num_cached_blocks(), 2);
    /// peers.check_cached_count()?;
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn check_cached_count(&self) -> Result<()> {
        let members: Vec<Arc<Mutex<KvCacheManager>>> = {
            let members = self.members.lock().unwrap_or_else(|p| p.into_inner());
            members.iter().filter_map(Weak::upgrade).collect()
        };
        let mut locked = Vec::with_capacity(members.len());
        for member in &members {
            match member.lock() {
                Ok(kv) => locked.push(kv),
                Err(_) => return Ok(()),
            }
        }
        let Some(first) = locked.first() else {
            return Ok(());
        };
        let pool = Arc::clone(first.pool());
        let mut cached = 0;
        for (i, kv) in locked.iter().enumerate() {
            if !Arc::ptr_eq(kv.pool(), &pool) {
                return Err(Error::InvariantViolation(format!(
                    "pool peer {i} allocates from another pool than peer 0"
                )));
            }
            cached += kv.stats().num_cached_blocks;
        }
        match pool.cached_count_with_managers(locked.len()) {
            Some(counted) if counted != cached => Err(Error::InvariantViolation(format!(
                "pool counts {counted} cached blocks, its {} managers cache {cached}",
                locked.len()
            ))),
            _ => Ok(()),
        }
    }

    /// Runs `op` on `me` (locked); when it fails for lack of device blocks, reclaims the
    /// shortfall from the peers and runs it once more (see the module docs). A poisoned lock
    /// on `me` is an [`Error::InvariantViolation`].
    pub fn run<T>(
        &self,
        me: &Arc<Mutex<KvCacheManager>>,
        mut op: impl FnMut(&mut KvCacheManager) -> Result<T>,
    ) -> Result<T> {
        let lock = || {
            me.lock().map_err(|_| {
                Error::InvariantViolation(
                    "KvCacheManager is unusable: a call panicked while holding its lock".into(),
                )
            })
        };
        // On failure, also read how many cached blocks the peers hold (the pool's count minus
        // ours): a shortfall they cannot cover fails at once, leaving the peers' caches alone.
        let (first, peers_cached) = {
            let mut kv = lock()?;
            let result = op(&mut kv);
            let peers_cached = match &result {
                Err(Error::OutOfBlocks { .. }) => kv
                    .pool()
                    .num_cached_blocks()
                    .saturating_sub(kv.stats().num_cached_blocks),
                _ => 0,
            };
            (result, peers_cached)
        };
        match first {
            Err(Error::OutOfBlocks {
                tier: Tier::Device,
                needed_blocks,
                available_blocks,
            }) => {
                let shortfall = needed_blocks.saturating_sub(available_blocks).max(1);
                if shortfall > peers_cached || self.reclaim(me, shortfall) == 0 {
                    return first;
                }
                op(&mut *lock()?)
            }
            other => other,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::{Arc, Mutex};

    use crate::{BlockPool, Error, KvCacheManager, ManagerConfig, PoolPeers};

    fn caching() -> ManagerConfig {
        ManagerConfig {
            enable_prefix_caching: true,
            ..Default::default()
        }
    }

    /// A manager with one block in its cache, alone on a pool another `Arc` also holds.
    fn one_cached(pool: &Arc<BlockPool>) -> KvCacheManager {
        let mut kv = KvCacheManager::with_pool(Arc::clone(pool), caching()).unwrap();
        kv.add_sequence(1, &[1; 16], None).unwrap();
        kv.free(1).unwrap();
        assert_eq!(pool.num_cached_blocks(), 1);
        kv
    }

    #[test]
    fn a_miscount_fails_the_check_of_the_pools_only_manager() {
        let pool = Arc::new(BlockPool::new(8, 16).unwrap());
        let mut kv = one_cached(&pool);
        kv.check_invariants().unwrap();
        pool.count_cached(1);
        assert!(
            matches!(kv.check_invariants(), Err(Error::InvariantViolation(m)) if m.contains("cached"))
        );
        // With a second manager on the pool the manager alone cannot tell: a bound only.
        let other = KvCacheManager::with_pool(Arc::clone(&pool), caching()).unwrap();
        kv.check_invariants().unwrap();
        // Dropping it detaches it: exact again.
        drop(other);
        assert!(kv.check_invariants().is_err());
    }

    #[test]
    fn a_miscount_fails_the_peer_groups_check() {
        let pool = Arc::new(BlockPool::new(8, 16).unwrap());
        let peers = PoolPeers::default();
        let a = Arc::new(Mutex::new(one_cached(&pool)));
        let b = Arc::new(Mutex::new(
            KvCacheManager::with_pool(Arc::clone(&pool), caching()).unwrap(),
        ));
        peers.join(&a);
        peers.join(&b);
        peers.check_cached_count().unwrap();
        // A manager outside the group: the group cannot tell, so it checks nothing.
        let outsider = KvCacheManager::with_pool(Arc::clone(&pool), caching()).unwrap();
        pool.count_cached(1);
        peers.check_cached_count().unwrap();
        // Once it is dropped the members are all the pool's managers again: the miscount shows.
        drop(outsider);
        assert!(matches!(
            peers.check_cached_count(),
            Err(Error::InvariantViolation(m)) if m.contains("cached")
        ));
    }

    #[test]
    fn a_peer_on_another_pool_is_reported() {
        let peers = PoolPeers::default();
        let members: Vec<_> = (0..2)
            .map(|_| Arc::new(Mutex::new(KvCacheManager::new(caching()).unwrap())))
            .collect();
        for m in &members {
            peers.join(m);
        }
        assert!(matches!(
            peers.check_cached_count(),
            Err(Error::InvariantViolation(m)) if m.contains("another pool")
        ));
    }
}
