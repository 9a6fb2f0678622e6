//! The requests to replay, validated once so that the step loop can trust them.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use pagedkv::{Error, Result, MAX_NUM_SLOTS};

use crate::prefix_blocks::PrefixBlocks;

/// How the sequences of one request relate (vLLM's parallel sampling and beam search).
///
/// ```
/// use pagedkv_sim::GroupKind;
/// assert_eq!("beam".parse::<GroupKind>()?, GroupKind::Beam);
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// One sequence per request (`group_size` must be 1).
    None,
    /// `n` samples forked from the prompt, each generating independently.
    Parallel,
    /// `width` beams forked from the prompt; every step each new beam picks a parent beam
    /// (forks shared blocks, drops unpicked beams), as vLLM's block manager sees beam search.
    Beam,
}

impl FromStr for GroupKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(GroupKind::None),
            "parallel" => Ok(GroupKind::Parallel),
            "beam" => Ok(GroupKind::Beam),
            other => Err(Error::InvalidArgument(format!(
                "unknown group_kind {other:?}; expected one of: none, parallel, beam"
            ))),
        }
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GroupKind::None => "none",
            GroupKind::Parallel => "parallel",
            GroupKind::Beam => "beam",
        })
    }
}

/// One request of a workload.
///
/// ```
/// use pagedkv_sim::RequestSpec;
/// let r = RequestSpec { prompt_tokens: 100, output_tokens: 20, arrival_s: 0.5, group_size: 1, prefix: None };
/// assert_eq!(r.final_len(), 120);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestSpec {
    /// Prompt length (>= 1), including any shared prefix.
    pub prompt_tokens: usize,
    /// Tokens each sequence of the request generates (>= 1).
    pub output_tokens: usize,
    /// Arrival time in seconds (used with `Arrival::Trace`).
    pub arrival_s: f64,
    /// Sequences in the group (1 = plain request).
    pub group_size: usize,
    /// Shared system prompt: `(prefix_id, prefix_tokens)`, the first `prefix_tokens` of the
    /// prompt being the same token ids for every request with that `prefix_id`.
    pub prefix: Option<(u64, usize)>,
}

impl RequestSpec {
    /// Length of each of its sequences when finished: prompt + output.
    pub fn final_len(&self) -> usize {
        self.prompt_tokens + self.output_tokens
    }
}

/// A validated list of requests.
///
/// ```
/// use pagedkv_sim::{GroupKind, Workload};
/// let w = Workload::from_arrays(&[10, 20], &[5, 1], &[0.0, 0.1], None, GroupKind::None, None, None)?;
/// assert_eq!(w.requests().len(), 2);
/// let err = Workload::from_arrays(&[10, -1], &[5, 1], &[0.0, 0.1], None, GroupKind::None, None, None);
/// assert!(err.unwrap_err().to_string().contains("request 1"));
/// # Ok::<(), pagedkv::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    requests: Vec<RequestSpec>,
    group_kind: GroupKind,
    /// Trace prefix blocks of every request (then no request has a `prefix`), if any.
    prefix_blocks: Option<Arc<PrefixBlocks>>,
}

impl Workload {
    /// Builds a workload from per-request columns (all of length R), validating every value;
    /// errors name the offending request index.
    ///
    /// - `prompt_tokens`, `output_tokens`: `[R]`, each >= 1.
    /// - `arrival_s`: `[R]` seconds, finite, >= 0 and non-decreasing.
    /// - `group_size`: `[R]` >= 1, or `None` for all 1; must be all 1 when `group_kind` is `None`.
    /// - `prefix_id`: `[R]`, -1 for none; `prefix_tokens`: `[R]`, 0 ..= prompt length (0 when
    ///   `prefix_id` is -1). Both or neither.
    #[allow(clippy::too_many_arguments)]
    pub fn from_arrays(
        prompt_tokens: &[i64],
        output_tokens: &[i64],
        arrival_s: &[f64],
        group_size: Option<&[i64]>,
        group_kind: GroupKind,
        prefix_id: Option<&[i64]>,
        prefix_tokens: Option<&[i64]>,
    ) -> Result<Workload> {
        let n = prompt_tokens.len();
        let check_len = |name: &str, len: usize| {
            if len == n {
                Ok(())
            } else {
                Err(Error::InvalidArgument(format!(
                    "{name} has {len} entries but prompt_tokens has {n}; every column needs one entry per request"
                )))
            }
        };
        check_len("output_tokens", output_tokens.len())?;
        check_len("arrival_s", arrival_s.len())?;
        if let Some(g) = group_size {
            check_len("group_size", g.len())?;
        }
        match (prefix_id, prefix_tokens) {
            (Some(ids), Some(lens)) => {
                check_len("prefix_id", ids.len())?;
                check_len("prefix_tokens", lens.len())?;
            }
            (None, None) => {}
            _ => {
                return Err(Error::InvalidArgument(
                    "prefix_id and prefix_tokens must be given together".into(),
                ))
            }
        }
        let bad =
            |i: usize, msg: String| Err(Error::InvalidArgument(format!("request {i}: {msg}")));
        let mut requests = Vec::with_capacity(n);
        let mut prev_arrival = 0.0f64;
        for i in 0..n {
            let p = prompt_tokens[i];
            let o = output_tokens[i];
            if p < 1 {
                return bad(i, format!("prompt_tokens is {p} (must be at least 1)"));
            }
            if o < 1 {
                return bad(i, format!("output_tokens is {o} (must be at least 1)"));
            }
            if p > MAX_NUM_SLOTS as i64 || o > MAX_NUM_SLOTS as i64 {
                return bad(
                    i,
                    format!("{p} prompt + {o} output tokens is more than any pool holds ({MAX_NUM_SLOTS} slots)"),
                );
            }
            let a = arrival_s[i];
            if !a.is_finite() || a < 0.0 {
                return bad(
                    i,
                    format!("arrival_s is {a} (must be a finite number >= 0)"),
                );
            }
            if a < prev_arrival {
                return bad(i, format!("arrival_s {a} is earlier than the previous request's {prev_arrival} (must be non-decreasing)"));
            }
            prev_arrival = a;
            let g = group_size.map_or(1, |g| g[i]);
            if g < 1 {
                return bad(i, format!("group_size is {g} (must be at least 1)"));
            }
            if group_kind == GroupKind::None && g != 1 {
                return bad(
                    i,
                    format!(
                        "group_size is {g} but group_kind is 'none' (use 'parallel' or 'beam')"
                    ),
                );
            }
            let prefix = match (prefix_id, prefix_tokens) {
                (Some(ids), Some(lens)) => {
                    let (id, len) = (ids[i], lens[i]);
                    if id < -1 {
                        return bad(
                            i,
                            format!("prefix_id is {id} (must be -1 for none, or >= 0)"),
                        );
                    }
                    if len < 0 || len > p {
                        return bad(
                            i,
                            format!(
                                "prefix_tokens is {len} (must lie in 0..={p}, the prompt length)"
                            ),
                        );
                    }
                    if id == -1 && len != 0 {
                        return bad(
                            i,
                            format!("prefix_tokens is {len} but prefix_id is -1 (no prefix)"),
                        );
                    }
                    (id >= 0 && len > 0).then_some((id as u64, len as usize))
                }
                _ => None,
            };
            requests.push(RequestSpec {
                prompt_tokens: p as usize,
                output_tokens: o as usize,
                arrival_s: a,
                group_size: g as usize,
                prefix,
            });
        }
        Ok(Workload {
            requests,
            group_kind,
            prefix_blocks: None,
        })
    }

    /// The same requests, their prompts now chains of trace blocks (`blocks` describes every
    /// request; a prompt longer than its blocks ends in tokens of its own). Refused when a request
    /// also has a `prefix` (one way to share tokens per workload), when `blocks` describes
    /// another number of requests, or when a request lists more blocks than its prompt reaches.
    ///
    /// ```
    /// use pagedkv_sim::{GroupKind, PrefixBlocks, Workload};
    /// let w = Workload::from_arrays(&[600, 1000], &[1, 1], &[0.0; 2], None, GroupKind::None, None, None)?
    ///     .with_prefix_blocks(PrefixBlocks::new(512, &[0, 2, 4], &[1, 2, 1, 3])?)?;
    /// assert_eq!(w.prefix_blocks().unwrap().of(1), &[1, 3]);
    /// # Ok::<(), pagedkv::Error>(())
    /// ```
    pub fn with_prefix_blocks(mut self, blocks: PrefixBlocks) -> Result<Workload> {
        if blocks.num_requests() != self.requests.len() {
            return Err(Error::InvalidArgument(format!(
                "prefix blocks describe {} requests but the workload has {}",
                blocks.num_requests(),
                self.requests.len()
            )));
        }
        for (i, spec) in self.requests.iter().enumerate() {
            if spec.prefix.is_some() {
                return Err(Error::InvalidArgument(format!(
                    "request {i}: has both a prefix_id and prefix blocks (give one or the other)"
                )));
            }
            let listed = blocks.of(i).len();
            let reach = spec.prompt_tokens.div_ceil(blocks.block_tokens());
            if listed > reach {
                return Err(Error::InvalidArgument(format!(
                    "request {i}: {listed} prefix blocks of {} tokens, but its {}-token prompt reaches only {reach}",
                    blocks.block_tokens(),
                    spec.prompt_tokens
                )));
            }
        }
        self.prefix_blocks = Some(Arc::new(blocks));
        Ok(self)
    }

    /// The trace prefix blocks, if the prompts are block chains.
    pub fn prefix_blocks(&self) -> Option<&PrefixBlocks> {
        self.prefix_blocks.as_deref()
    }

    /// A shared handle to the trace prefix blocks (what the allocator's token source keeps).
    pub(crate) fn prefix_blocks_arc(&self) -> Option<Arc<PrefixBlocks>> {
        self.prefix_blocks.clone()
    }

    /// A workload of plain requests from already-checked specs (validated the same way).
    pub fn new(requests: Vec<RequestSpec>, group_kind: GroupKind) -> Result<Workload> {
        let col = |f: &dyn Fn(&RequestSpec) -> i64| requests.iter().map(f).collect::<Vec<i64>>();
        let prompt = col(&|r| r.prompt_tokens as i64);
        let output = col(&|r| r.output_tokens as i64);
        let group = col(&|r| r.group_size as i64);
        let prefix_id = col(&|r| r.prefix.map_or(-1, |(id, _)| id as i64));
        let prefix_len = col(&|r| r.prefix.map_or(0, |(_, len)| len as i64));
        let arrival: Vec<f64> = requests.iter().map(|r| r.arrival_s).collect();
        Workload::from_arrays(
            &prompt,
            &output,
            &arrival,
            Some(&group),
            group_kind,
            Some(&prefix_id),
            Some(&prefix_len),
        )
    }

    /// The requests in arrival order.
    pub fn requests(&self) -> &[RequestSpec] {
        &self.requests
    }

    /// How each request's sequences relate.
    pub fn group_kind(&self) -> GroupKind {
        self.group_kind
    }

    /// Whether any request has more than one sequence.
    pub fn has_groups(&self) -> bool {
        self.requests.iter().any(|r| r.group_size > 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(p: &[i64], o: &[i64]) -> Result<Workload> {
        let a = vec![0.0; p.len()];
        Workload::from_arrays(p, o, &a, None, GroupKind::None, None, None)
    }

    #[test]
    fn rejects_each_malformed_column_naming_the_request() {
        let msg = |r: Result<Workload>| r.unwrap_err().to_string();
        assert!(msg(plain(&[5, 0], &[1, 1])).contains("request 1: prompt_tokens is 0"));
        assert!(msg(plain(&[5, 5, 5], &[1, 1, -7])).contains("request 2: output_tokens is -7"));
        assert!(msg(plain(&[5, 1 << 40], &[1, 1])).contains("request 1: 1099511627776 prompt"));
        assert!(msg(plain(&[5], &[1, 1])).contains("output_tokens has 2 entries"));
        let e = Workload::from_arrays(
            &[1, 1],
            &[1, 1],
            &[1.0, 0.5],
            None,
            GroupKind::None,
            None,
            None,
        );
        assert!(msg(e).contains("request 1: arrival_s 0.5 is earlier"));
        let e = Workload::from_arrays(&[1], &[1], &[f64::NAN], None, GroupKind::None, None, None);
        assert!(msg(e).contains("request 0: arrival_s is NaN"));
        let e = Workload::from_arrays(&[1], &[1], &[0.0], Some(&[2]), GroupKind::None, None, None);
        assert!(msg(e).contains("group_kind is 'none'"));
        let e = Workload::from_arrays(&[1], &[1], &[0.0], Some(&[0]), GroupKind::Beam, None, None);
        assert!(msg(e).contains("group_size is 0"));
        let e = Workload::from_arrays(
            &[10],
            &[1],
            &[0.0],
            None,
            GroupKind::None,
            Some(&[3]),
            Some(&[11]),
        );
        assert!(msg(e).contains("prefix_tokens is 11"));
        let e = Workload::from_arrays(
            &[10],
            &[1],
            &[0.0],
            None,
            GroupKind::None,
            Some(&[-1]),
            Some(&[4]),
        );
        assert!(msg(e).contains("prefix_id is -1"));
        let e = Workload::from_arrays(&[10], &[1], &[0.0], None, GroupKind::None, Some(&[1]), None);
        assert!(msg(e).contains("given together"));
    }

    #[test]
    fn prefix_blocks_must_fit_the_workload() {
        let blocks = |offsets: &[i64], ids: &[i64]| PrefixBlocks::new(4, offsets, ids).unwrap();
        let msg = |r: Result<Workload>| r.unwrap_err().to_string();
        let w = plain(&[8, 5], &[1, 1]).unwrap();
        assert!(msg(w.clone().with_prefix_blocks(blocks(&[0, 1], &[3])))
            .contains("describe 1 requests"));
        // 5 tokens reach 2 blocks of 4, not 3.
        assert!(msg(w
            .clone()
            .with_prefix_blocks(blocks(&[0, 2, 5], &[1, 2, 1, 2, 3])))
        .contains("request 1: 3 prefix blocks"));
        let ok = w
            .with_prefix_blocks(blocks(&[0, 2, 4], &[1, 2, 1, 3]))
            .unwrap();
        assert_eq!(ok.prefix_blocks().unwrap().of(1), &[1, 3]);
        let with_prefix = Workload::from_arrays(
            &[8],
            &[1],
            &[0.0],
            None,
            GroupKind::None,
            Some(&[0]),
            Some(&[4]),
        )
        .unwrap();
        assert!(
            msg(with_prefix.with_prefix_blocks(blocks(&[0, 1], &[1]))).contains("both a prefix_id")
        );
    }

    #[test]
    fn accepts_groups_and_prefixes() {
        let w = Workload::from_arrays(
            &[10, 20],
            &[3, 4],
            &[0.0, 0.0],
            Some(&[4, 1]),
            GroupKind::Parallel,
            Some(&[7, -1]),
            Some(&[8, 0]),
        )
        .unwrap();
        assert!(w.has_groups());
        assert_eq!(w.requests()[0].prefix, Some((7, 8)));
        assert_eq!(w.requests()[1].prefix, None);
        assert_eq!(
            Workload::new(w.requests().to_vec(), GroupKind::Parallel).unwrap(),
            w
        );
    }
}
