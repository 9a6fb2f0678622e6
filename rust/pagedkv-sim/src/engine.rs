//! The continuous-batching step loop.
//!
//! Each step: (1) requests whose arrival time has come join the waiting queue; (2) every beam
//! group takes one beam-search step; (3) every running sequence gets a slot for its next token;
//! if the paged pool runs out, the most recently admitted group is preempted (recompute or
//! swap) until the rest fit; (4) if nobody was preempted, swapped-out groups come back first,
//! then waiting requests are admitted while they fit, first-come-first-served or in the order of
//! a cache-aware policy (`SimConfig::scheduling`; the request due next blocks the rest); an
//! admitted request is prefilled and generates its first token in the same step; (5) the pool is
//! accounted; (6) finished requests release their memory.

use std::collections::VecDeque;

use pagedkv::{Error, Result, SeqId, MAX_NUM_BLOCKS};

use crate::config::{AllocatorKind, Arrival, Preemption, Scheduling, SimConfig};
use crate::contiguous::ContiguousMemory;
use crate::frames::Frame;
use crate::group::Group;
use crate::memory::Admission;
use crate::memory::KvMemory;
use crate::metrics::{Accumulator, SimResult};
use crate::optimum::optimal_hits;
use crate::paged::PagedMemory;
use crate::policy_waiting::PolicyWaiting;
use crate::rng::SplitMix64;
use crate::tokens::PromptSource;
use crate::workload::{GroupKind, Workload};

/// Progress of a running simulation, passed to the progress callback.
///
/// ```
/// use pagedkv_sim::SimProgress;
/// let p = SimProgress { steps: 10, finished_requests: 3, total_requests: 8 };
/// assert_eq!(p.total_requests - p.finished_requests, 5);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimProgress {
    /// Steps run so far.
    pub steps: usize,
    /// Requests finished so far.
    pub finished_requests: usize,
    /// Requests in the workload.
    pub total_requests: usize,
}

/// Steps between two progress callbacks.
const PROGRESS_EVERY_STEPS: usize = 8192;

/// Replays `workload` under `config` and returns the time-averaged metrics.
///
/// ```
/// use pagedkv_sim::{simulate, AllocatorKind, GroupKind, SimConfig, Workload};
/// let w = Workload::from_arrays(&[100; 8], &[50; 8], &[0.0; 8], None, GroupKind::None, None, None)?;
/// let paged = simulate(&w, &SimConfig { num_slots: 1024, ..Default::default() })?;
/// let max = simulate(&w, &SimConfig { num_slots: 1024, max_model_len: 512,
///                                     allocator: AllocatorKind::ContiguousMax, ..Default::default() })?;
/// assert!(paged.mean_resident_requests > max.mean_resident_requests);
/// assert!(paged.token_states > max.token_states);
/// # Ok::<(), pagedkv::Error>(())
/// ```
pub fn simulate(workload: &Workload, config: &SimConfig) -> Result<SimResult> {
    run(workload, config, None, None)
}

/// [`simulate`] with a callback every few thousand steps; returning `false` stops the run early
/// (the result then covers the steps run so far).
pub fn simulate_with_progress(
    workload: &Workload,
    config: &SimConfig,
    progress: &mut dyn FnMut(SimProgress) -> bool,
) -> Result<SimResult> {
    run(workload, config, Some(progress), None)
}

/// Runs at most `max_steps` steps (fewer if `config.max_steps` is smaller) and returns the
/// result of those steps together with one [`Frame`] per step.
pub fn record_frames(
    workload: &Workload,
    config: &SimConfig,
    max_steps: usize,
) -> Result<(SimResult, Vec<Frame>)> {
    if max_steps == 0 {
        return Err(Error::InvalidArgument(
            "max_steps must be at least 1".into(),
        ));
    }
    let num_cells = config.num_slots.div_ceil(config.block_size.max(1));
    if num_cells > MAX_NUM_BLOCKS {
        return Err(Error::InvalidArgument(format!(
            "record_frames draws one cell per block of {} slots: {num_cells} cells is more than {MAX_NUM_BLOCKS}",
            config.block_size
        )));
    }
    let mut config = config.clone();
    config.max_steps = Some(config.max_steps.map_or(max_steps, |m| m.min(max_steps)));
    let mut frames = Vec::new();
    let result = run(workload, &config, None, Some(&mut frames))?;
    Ok((result, frames))
}

/// Checks that every request could run alone in an empty pool under `config`.
fn validate_against_config(workload: &Workload, config: &SimConfig) -> Result<()> {
    let bs = config.block_size;
    for (i, spec) in workload.requests().iter().enumerate() {
        let len = spec.final_len();
        if len > config.max_model_len {
            return Err(Error::InvalidArgument(format!(
                "request {i}: prompt {} + output {} = {len} tokens exceeds max_model_len {}",
                spec.prompt_tokens, spec.output_tokens, config.max_model_len
            )));
        }
        if spec.group_size > config.max_num_seqs {
            return Err(Error::InvalidArgument(format!(
                "request {i}: group of {} sequences exceeds max_num_seqs {}",
                spec.group_size, config.max_num_seqs
            )));
        }
        let group = if spec.group_size > 1 {
            format!(" (group of {})", spec.group_size)
        } else {
            String::new()
        };
        match config.allocator {
            AllocatorKind::Paged => {
                let needed = PagedMemory::blocks_for(spec, len, bs);
                if needed > config.num_blocks() {
                    return Err(Error::InvalidArgument(format!(
                        "request {i}{group} needs {needed} blocks of {bs} slots for {len} tokens per sequence, \
                         but the whole pool has only {} blocks",
                        config.num_blocks()
                    )));
                }
            }
            _ => {
                let (fits, extent) = ContiguousMemory::fits_empty_pool(config, spec);
                if !fits {
                    return Err(Error::InvalidArgument(format!(
                        "request {i}{group} needs a contiguous reservation of {extent} slots per sequence \
                         ({} placement), which the whole pool of {} slots cannot hold",
                        config.placement, config.num_slots
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Arrival time of every request, from 0.
fn arrival_times(workload: &Workload, config: &SimConfig) -> Vec<f64> {
    let requests = workload.requests();
    match config.arrival {
        Arrival::Saturated => vec![0.0; requests.len()],
        Arrival::Trace => {
            let origin = requests.first().map_or(0.0, |r| r.arrival_s);
            requests.iter().map(|r| r.arrival_s - origin).collect()
        }
        Arrival::Poisson => {
            let mut rng = SplitMix64::new(config.seed ^ 0xA771_7A15);
            let mut now = 0.0;
            requests
                .iter()
                .map(|_| {
                    now += rng.next_exponential(config.poisson_rate);
                    now
                })
                .collect()
        }
    }
}

fn run(
    workload: &Workload,
    config: &SimConfig,
    progress: Option<&mut dyn FnMut(SimProgress) -> bool>,
    frames: Option<&mut Vec<Frame>>,
) -> Result<SimResult> {
    config.validate()?;
    validate_against_config(workload, config)?;
    let mut memory: Box<dyn KvMemory> = match config.allocator {
        AllocatorKind::Paged => Box::new(PagedMemory::new(
            config,
            workload.has_groups(),
            PromptSource::new(workload),
            config.scheduling != Scheduling::Fcfs,
        )?),
        _ => Box::new(ContiguousMemory::new(config)),
    };
    let mut result = Engine::new(workload, config).run(memory.as_mut(), progress, frames)?;
    if config.allocator == AllocatorKind::Paged && config.enable_prefix_caching {
        let best = optimal_hits(workload, config.block_size, config.seed)?;
        result.optimal_prompt_tokens = best.prompt_tokens;
        result.optimal_hit_tokens = best.hit_tokens;
    }
    Ok(result)
}

struct Engine<'a> {
    workload: &'a Workload,
    config: &'a SimConfig,
    arrivals: Vec<f64>,
    next_arrival: usize,
    /// Arrived, not admitted; the front is the next to admit (recomputed groups go back here).
    /// Under a cache-aware policy only recomputed groups wait here, ahead of `policy`.
    waiting: VecDeque<Group>,
    /// Arrived requests under a cache-aware policy (`None`: first come, first served).
    policy: Option<PolicyWaiting>,
    /// When each request was first admitted (NaN until then).
    admitted_at_s: Vec<f64>,
    /// Swapped out to the host tier; swapped back in (front first) before new admissions.
    swapped: VecDeque<Group>,
    /// Admitted groups holding device memory, in admission order (the last is the next victim).
    running: Vec<Group>,
    running_seqs: usize,
    next_seq_id: SeqId,
    beam_rng: SplitMix64,
    now_s: f64,
    result: SimResult,
    sums: Accumulator,
}

impl<'a> Engine<'a> {
    fn new(workload: &'a Workload, config: &'a SimConfig) -> Self {
        Engine {
            workload,
            config,
            arrivals: arrival_times(workload, config),
            next_arrival: 0,
            waiting: VecDeque::new(),
            policy: (config.scheduling != Scheduling::Fcfs)
                .then(|| PolicyWaiting::new(config, workload.requests().len())),
            admitted_at_s: vec![f64::NAN; workload.requests().len()],
            swapped: VecDeque::new(),
            running: Vec::new(),
            running_seqs: 0,
            next_seq_id: 0,
            beam_rng: SplitMix64::new(config.seed ^ 0xBEA4_5EA4),
            now_s: 0.0,
            result: SimResult {
                num_slots: config.num_slots,
                scheduling: config.scheduling,
                aging_bound: config.aging_bound,
                ..Default::default()
            },
            sums: Accumulator::default(),
        }
    }

    fn run(
        mut self,
        memory: &mut dyn KvMemory,
        mut progress: Option<&mut dyn FnMut(SimProgress) -> bool>,
        mut frames: Option<&mut Vec<Frame>>,
    ) -> Result<SimResult> {
        let total = self.workload.requests().len();
        loop {
            if self
                .config
                .max_steps
                .is_some_and(|m| self.result.steps >= m)
            {
                break;
            }
            self.take_arrivals(memory)?;
            if self.running.is_empty() && !self.anything_waits() {
                match self.arrivals.get(self.next_arrival) {
                    // Idle until the next arrival: no steps are run in between.
                    Some(&t) => {
                        self.now_s = self.now_s.max(t);
                        continue;
                    }
                    None => break,
                }
            }
            self.step(memory, frames.as_deref_mut())?;
            if let Some(callback) = progress.as_deref_mut() {
                if self.result.steps % PROGRESS_EVERY_STEPS == 0
                    && !callback(SimProgress {
                        steps: self.result.steps,
                        finished_requests: self.result.finished_requests,
                        total_requests: total,
                    })
                {
                    break;
                }
            }
        }
        self.result.simulated_seconds = self.now_s;
        self.sums.finish(&mut self.result);
        if let Some(policy) = &self.policy {
            let stats = policy.stats();
            self.result.max_passed_over = stats.max_passed_over as usize;
            self.result.forced_admissions = stats.forced_admissions as usize;
            self.result.evicted_wanted_blocks = stats.evicted_wanted_blocks as usize;
        }
        Ok(self.result)
    }

    /// Whether any request waits for admission (new, recomputed or swapped out).
    fn anything_waits(&self) -> bool {
        !self.waiting.is_empty()
            || !self.swapped.is_empty()
            || self.policy.as_ref().is_some_and(|p| p.len() > 0)
    }

    fn take_arrivals(&mut self, memory: &mut dyn KvMemory) -> Result<()> {
        let requests = self.workload.requests();
        while self.next_arrival < requests.len() && self.arrivals[self.next_arrival] <= self.now_s {
            let i = self.next_arrival;
            let group = Group::new(i, requests[i]);
            match self.policy.as_mut() {
                Some(policy) => policy.push(memory, group)?,
                None => self.waiting.push_back(group),
            }
            self.next_arrival += 1;
        }
        Ok(())
    }

    fn step(&mut self, memory: &mut dyn KvMemory, frames: Option<&mut Vec<Frame>>) -> Result<()> {
        let step = self.result.steps;
        if self.workload.group_kind() == GroupKind::Beam {
            for group in self.running.iter_mut() {
                memory.beam_step(group, &mut self.beam_rng, &mut self.next_seq_id)?;
            }
        }
        // Decode: everyone running gets its next slot, preempting from the back as needed.
        let mut preempted = false;
        while memory.append_one(&self.running)?.is_some() {
            let victim = self.running.pop().ok_or_else(|| {
                Error::InvariantViolation(
                    "out of blocks with no running request left to preempt".into(),
                )
            })?;
            self.preempt(memory, victim)?;
            preempted = true;
        }
        for group in self.running.iter_mut() {
            group.generated += 1;
            self.result.generated_tokens += group.members.len();
        }
        if !preempted {
            self.admit(memory)?;
            if self.running.is_empty() && self.anything_waits() {
                // Validation guarantees that a lone request fits an empty pool.
                return Err(Error::InvariantViolation(
                    "nothing runs and the head of the queue cannot be admitted".into(),
                ));
            }
        }
        // Account the pool as the step's forward pass sees it.
        let head = self.swapped.front().or(self.waiting.front());
        let queued = self.anything_waits();
        let shares = memory.sample(&self.running, head)?;
        if shares.total() != self.config.num_slots {
            return Err(Error::InvariantViolation(format!(
                "slot states sum to {} but the pool has {} slots",
                shares.total(),
                self.config.num_slots
            )));
        }
        let used_blocks = memory.used_blocks();
        self.sums.add(
            &shares,
            queued,
            self.running.len(),
            self.running_seqs,
            used_blocks,
        );
        self.result.peak_resident_requests =
            self.result.peak_resident_requests.max(self.running.len());
        if let Some(frames) = frames {
            let pool = memory.frame_pool(&self.running)?;
            frames.push(Frame {
                step,
                time_s: self.now_s,
                running: self.running.len(),
                waiting: self.waiting.len()
                    + self.swapped.len()
                    + self.policy.as_ref().map_or(0, PolicyWaiting::len),
                finished: self.result.finished_requests
                    + self.running.iter().filter(|g| g.is_finished()).count(),
                preemptions: self.result.preemptions,
                used_blocks: pool.cells.iter().filter(|c| c.owner >= 0).count(),
                shares,
                pool,
            });
        }
        self.release_finished(memory)?;
        if self.config.check_invariants {
            memory.check_invariants()?;
            if let Some(policy) = self.policy.as_mut() {
                policy.sync(memory)?;
                policy.check_invariants()?;
            }
        }
        self.result.steps += 1;
        self.now_s += self.config.step_time_s;
        Ok(())
    }

    fn preempt(&mut self, memory: &mut dyn KvMemory, mut victim: Group) -> Result<()> {
        self.result.preemptions += 1;
        self.running_seqs -= victim.members.len();
        if self.config.preemption == Preemption::Swap {
            if let Some(moved) = memory.swap_out(&mut victim)? {
                self.result.swap_preemptions += 1;
                self.result.swapped_out_blocks += moved;
                // Victims leave from the back, so pushing each to the front keeps admission order.
                self.swapped.push_front(victim);
                return Ok(());
            }
        }
        self.result.recompute_preemptions += 1;
        memory.release(&mut victim)?;
        self.waiting.push_front(victim);
        Ok(())
    }

    fn admit(&mut self, memory: &mut dyn KvMemory) -> Result<()> {
        if let Some(policy) = self.policy.as_mut() {
            policy.sync(memory)?;
        }
        // Under the aging bound, a group coming back from preemption may not pass over a due
        // request: then only the policy queue's head may go next.
        let mut held_back = false;
        while let Some(group) = self.swapped.front_mut() {
            let n = group.members.len();
            if self.running_seqs + n > self.config.max_num_seqs {
                return Ok(());
            }
            if let Some(policy) = self.policy.as_mut() {
                if !policy.may_admit_other(group.request) {
                    held_back = true;
                    break;
                }
            }
            let alone = self.running.is_empty();
            let Some(moved) = memory.try_swap_in(group, alone)? else {
                return Ok(());
            };
            let mut group = self.swapped.pop_front().expect("front exists");
            self.result.swapped_in_blocks += moved;
            group.generated += 1;
            self.result.generated_tokens += n;
            self.running_seqs += n;
            if let Some(policy) = self.policy.as_mut() {
                policy.other_admitted(group.request);
                policy.sync(memory)?;
            }
            self.running.push(group);
        }
        while let Some(group) = self.waiting.front_mut().filter(|_| !held_back) {
            let n = group.spec.group_size;
            if self.running_seqs + n > self.config.max_num_seqs {
                return Ok(());
            }
            if let Some(policy) = self.policy.as_mut() {
                if !policy.may_admit_other(group.request) {
                    break;
                }
            }
            let alone = self.running.is_empty();
            let Some(cost) = memory.try_admit(group, &mut self.next_seq_id, alone)? else {
                return Ok(());
            };
            let group = self.waiting.pop_front().expect("front exists");
            if let Some(policy) = self.policy.as_mut() {
                if group.generated > 0 {
                    policy.other_admitted(group.request);
                }
                policy.sync(memory)?;
            }
            self.record_admission(group, cost);
        }
        while let Some(policy) = self.policy.as_mut() {
            let Some(request) = policy.peek() else {
                return Ok(());
            };
            let group = policy.group_mut(request)?;
            if self.running_seqs + group.spec.group_size > self.config.max_num_seqs {
                return Ok(());
            }
            let alone = self.running.is_empty();
            let Some(cost) = memory.try_admit(group, &mut self.next_seq_id, alone)? else {
                return Ok(());
            };
            let group = policy.admitted(memory, request, cost.hit_tokens)?;
            self.record_admission(group, cost);
        }
        Ok(())
    }

    /// Books an admitted group's prefill and first token and starts it running.
    fn record_admission(&mut self, mut group: Group, cost: Admission) {
        let n = group.spec.group_size;
        self.result.prefix_query_tokens += cost.query_tokens;
        self.result.prefix_hit_tokens += cost.hit_tokens;
        self.result.prefill_tokens += cost.prefill_tokens;
        if group.generated > 0 {
            self.result.recomputed_tokens += cost.prefill_tokens;
        } else {
            self.result.prompt_tokens += group.spec.prompt_tokens;
            self.result.prompt_hit_tokens += cost.hit_tokens;
            self.admitted_at_s[group.request] = self.now_s;
        }
        group.generated += 1;
        self.result.generated_tokens += n;
        self.running_seqs += n;
        self.running.push(group);
    }

    fn release_finished(&mut self, memory: &mut dyn KvMemory) -> Result<()> {
        if !self.running.iter().any(Group::is_finished) {
            return Ok(());
        }
        let mut kept = Vec::with_capacity(self.running.len());
        for mut group in std::mem::take(&mut self.running) {
            if !group.is_finished() {
                kept.push(group);
                continue;
            }
            let figures = memory.finished_figures(&group)?;
            self.running_seqs -= group.members.len();
            memory.release(&mut group)?;
            self.result.finished_requests += 1;
            self.result.finished_request_ids.push(group.request);
            self.result
                .waste_per_request_tokens
                .push(figures.waste_slots);
            self.result.block_table_len.push(figures.block_table_len);
            self.result
                .wait_s
                .push(self.admitted_at_s[group.request] - self.arrivals[group.request]);
            // The request's last token is out at the end of this step.
            self.result
                .latency_s
                .push(self.now_s + self.config.step_time_s - self.arrivals[group.request]);
        }
        self.running = kept;
        Ok(())
    }
}
