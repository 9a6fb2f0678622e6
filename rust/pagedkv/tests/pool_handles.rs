//! Model-based test of the pool's generation-checked handles: random allocations, handle
//! retains and releases (including handles kept long after their block was freed and handed
//! out again) against a plain model of refcounts and generations. Every stale handle must be
//! refused with `StaleHandle` and change nothing; every step ends with the quiescent invariant
//! check and a refcount-by-refcount comparison with the model.

use pagedkv::{BlockHandle, BlockPool, Error};
use proptest::prelude::*;

const NUM_BLOCKS: usize = 6;

#[derive(Debug, Clone)]
enum Op {
    /// `pool.allocate(n)`, then a handle to each new block.
    Allocate(usize),
    /// `pool.handle(id)` (kept with the others when it succeeds).
    Handle(u32),
    /// `pool.retain` of the k-th handle ever taken (modulo their number).
    Retain(usize),
    /// `pool.release` of the k-th handle ever taken.
    Release(usize),
    /// `pool.release_all` of these handles, in order.
    ReleaseAll(Vec<usize>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..4).prop_map(Op::Allocate),
        1 => (0u32..NUM_BLOCKS as u32 + 1).prop_map(Op::Handle),
        2 => any::<usize>().prop_map(Op::Retain),
        4 => any::<usize>().prop_map(Op::Release),
        1 => prop::collection::vec(any::<usize>(), 0..4).prop_map(Op::ReleaseAll),
    ]
}

/// Per block: the refcount and the generation of its current (or last) tenancy.
#[derive(Default)]
struct Model {
    refcount: [u32; NUM_BLOCKS],
    generation: [u32; NUM_BLOCKS],
    handles: Vec<BlockHandle>,
}

impl Model {
    fn free(&self) -> usize {
        self.refcount.iter().filter(|&&r| r == 0).count()
    }

    /// What `retain(h)` must return, applying it to the model when it succeeds.
    fn retain(&mut self, h: BlockHandle) -> Result<u32, Error> {
        let b = h.id() as usize;
        if h.generation() != self.generation[b] || self.refcount[b] == 0 {
            return Err(Error::StaleHandle(h));
        }
        self.refcount[b] += 1;
        Ok(self.refcount[b])
    }

    /// What `release(h)` must return, applying it to the model when it succeeds.
    fn release(&mut self, h: BlockHandle) -> Result<bool, Error> {
        let b = h.id() as usize;
        if h.generation() != self.generation[b] {
            return Err(Error::StaleHandle(h));
        }
        if self.refcount[b] == 0 {
            return Err(Error::DoubleFree(h.id()));
        }
        self.refcount[b] -= 1;
        Ok(self.refcount[b] == 0)
    }

    fn pick(&self, k: usize) -> Option<BlockHandle> {
        (!self.handles.is_empty()).then(|| self.handles[k % self.handles.len()])
    }
}

fn step(pool: &BlockPool, model: &mut Model, op: &Op) {
    match op {
        Op::Allocate(n) => match pool.allocate(*n) {
            Ok(ids) => {
                assert!(
                    *n <= model.free(),
                    "allocated {n} with {} free",
                    model.free()
                );
                assert_eq!(ids.len(), *n);
                for id in ids {
                    let b = id as usize;
                    assert_eq!(model.refcount[b], 0, "block {id} handed out while held");
                    model.refcount[b] = 1;
                    model.generation[b] = model.generation[b].wrapping_add(1);
                    let h = pool.handle(id).unwrap();
                    assert_eq!(h.generation(), model.generation[b], "no new generation");
                    model.handles.push(h);
                }
            }
            Err(Error::OutOfBlocks {
                needed_blocks,
                available_blocks,
                ..
            }) => {
                assert_eq!((needed_blocks, available_blocks), (*n, model.free()));
            }
            Err(e) => panic!("allocate({n}): {e}"),
        },
        Op::Handle(id) => match pool.handle(*id) {
            Ok(h) => {
                let b = *id as usize;
                assert!(model.refcount[b] > 0);
                assert_eq!(h.generation(), model.generation[b]);
                model.handles.push(h);
            }
            Err(Error::InvalidArgument(_)) => {
                let b = *id as usize;
                assert!(b >= NUM_BLOCKS || model.refcount[b] == 0);
            }
            Err(e) => panic!("handle({id}): {e}"),
        },
        Op::Retain(k) => {
            if let Some(h) = model.pick(*k) {
                let expected = model.retain(h);
                assert_eq!(pool.retain(h), expected, "retain({h:?})");
            }
        }
        Op::Release(k) => {
            if let Some(h) = model.pick(*k) {
                let expected = model.release(h);
                assert_eq!(pool.release(h), expected, "release({h:?})");
            }
        }
        Op::ReleaseAll(ks) => {
            let hs: Vec<BlockHandle> = ks.iter().filter_map(|&k| model.pick(k)).collect();
            let mut expected = Ok(0);
            for &h in &hs {
                match model.release(h) {
                    Ok(freed) => expected = expected.map(|n| n + usize::from(freed)),
                    Err(e) => {
                        expected = Err(e);
                        break;
                    }
                }
            }
            assert_eq!(
                pool.release_all(hs.iter().copied()),
                expected,
                "release_all({hs:?})"
            );
        }
    }
}

fn run(ops: &[Op]) {
    let pool = BlockPool::new(NUM_BLOCKS, 4).unwrap();
    let mut model = Model::default();
    for op in ops {
        step(&pool, &mut model, op);
        pool.check_invariants_quiescent().unwrap();
        pool.check_invariants().unwrap();
        for b in 0..NUM_BLOCKS {
            assert_eq!(
                pool.refcount(b as u32).unwrap(),
                model.refcount[b],
                "block {b}"
            );
        }
        assert_eq!(pool.num_free_list_blocks(), model.free());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn stale_handles_are_always_refused(ops in prop::collection::vec(op(), 1..60)) {
        run(&ops);
    }
}

/// The scenario the model exists for, spelled out: a holder releases twice after the block
/// went to someone else; the second release is refused and the new holder keeps its block.
#[test]
fn a_late_release_cannot_take_a_reallocated_block() {
    run(&[
        Op::Allocate(1),
        Op::Release(0),
        Op::Allocate(1),
        Op::Release(0),
        Op::Retain(0),
        Op::ReleaseAll(vec![0, 1]),
    ]);
}
