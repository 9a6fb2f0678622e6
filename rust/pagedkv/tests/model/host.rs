//! The host swap tier of the reference model: `swap_out` moves whole sequences' tables to
//! host blocks (each distinct block once, keeping its reference count), `swap_in` brings them
//! back into fresh device blocks, all or nothing with the manager's errors.

use pagedkv::Tier;

use crate::reference::{distinct, Kind, MBlock, Model};

impl Model {
    pub fn host_free(&self) -> usize {
        self.num_host - self.host_refs.len()
    }

    /// Distinct live blocks of the group's tables, first seen first, with their references.
    pub fn group(&self, ids: &[u64]) -> (Vec<MBlock>, Vec<u32>) {
        let mut blocks: Vec<MBlock> = Vec::new();
        let mut refs = Vec::new();
        for id in ids {
            for t in &self.seqs[id].tables {
                for &b in t.iter().flatten() {
                    match blocks.iter().position(|&x| x == b) {
                        Some(i) => refs[i] += 1,
                        None => {
                            blocks.push(b);
                            refs.push(1);
                        }
                    }
                }
            }
        }
        (blocks, refs)
    }

    pub fn swap_out(&mut self, ids: &[u64]) -> Result<Vec<(MBlock, MBlock)>, Kind> {
        if self.num_host == 0 {
            return Err(Kind::Invalid);
        }
        distinct(ids)?;
        for &id in ids {
            self.resident(id)?;
        }
        let (blocks, refs) = self.group(ids);
        if blocks.len() > self.num_host {
            return Err(Kind::Invalid);
        }
        if blocks.len() > self.host_free() {
            return Err(Kind::Oob(Tier::Host, blocks.len(), self.host_free()));
        }
        let host: Vec<MBlock> = blocks.iter().map(|_| self.new_block()).collect();
        for (&h, &r) in host.iter().zip(&refs) {
            self.host_refs.insert(h, r);
        }
        let to_host = |d: &MBlock| host[blocks.iter().position(|b| b == d).unwrap()];
        for &id in ids {
            let mut s = self.seqs.remove(&id).unwrap();
            let device = std::mem::take(&mut s.tables);
            s.tables = device
                .iter()
                .map(|t| t.iter().map(|d| d.as_ref().map(to_host)).collect())
                .collect();
            s.swapped = true;
            self.seqs.insert(id, s);
            for t in &device {
                for &d in t.iter().rev().flatten() {
                    self.release(d);
                }
            }
        }
        Ok(blocks.into_iter().zip(host).collect())
    }

    pub fn swap_in(&mut self, ids: &[u64]) -> Result<Vec<(MBlock, MBlock)>, Kind> {
        if self.num_host == 0 {
            return Err(Kind::Invalid);
        }
        distinct(ids)?;
        for &id in ids {
            match self.seqs.get(&id) {
                None => return Err(Kind::Unknown(id)),
                Some(s) if !s.swapped => return Err(Kind::Invalid),
                Some(_) => {}
            }
        }
        let (host, refs) = self.group(ids);
        if host.len() > self.num_blocks {
            return Err(Kind::Invalid);
        }
        if host.len() > self.available() {
            return Err(Kind::Oob(Tier::Device, host.len(), self.available()));
        }
        let device = self.alloc_fresh(host.len());
        for (&d, &r) in device.iter().zip(&refs) {
            self.refcounts.insert(d, r);
        }
        for &id in ids {
            let mut s = self.seqs.remove(&id).unwrap();
            for t in s.tables.iter_mut() {
                for h in t.iter_mut().flatten() {
                    let rc = self.host_refs.get_mut(h).unwrap();
                    *rc -= 1;
                    if *rc == 0 {
                        self.host_refs.remove(h);
                    }
                    *h = device[host.iter().position(|x| x == h).unwrap()];
                }
            }
            s.swapped = false;
            self.seqs.insert(id, s);
        }
        Ok(host.into_iter().zip(device).collect())
    }
}
