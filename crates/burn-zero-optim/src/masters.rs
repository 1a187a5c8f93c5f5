//! [`Masters`]: every fp32 master copy one side of the optimizer holds, with its optimizer
//! state.
//!
//! A parameter stepped alone has a master of its own; a chunk stepped whole has one flat
//! master, its members' parts end to end (see `chunked`). Records stay per parameter whatever
//! the layout: a chunk's master is split at its members' boundaries when recorded, and
//! restored entries wait as per-parameter masters until the chunk's first step joins them.
//! This module owns both maps and those two conversions, so the rest of the optimizer asks for
//! a master by parameter or by chunk and never sees how they are kept.

use std::collections::BTreeMap;

use burn::optim::SimpleOptimizer;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_zero_core::chunk::{Chunk, ChunkLayout};

use crate::master::Master;
use crate::state_tree::{join_states, split_state};

/// One side's master copies: by parameter, and by chunk.
pub(crate) struct Masters<O: SimpleOptimizer<H>, H: Backend> {
    /// Masters of parameters stepped alone, or restored and not yet joined into their chunk's,
    /// by parameter key.
    by_param: BTreeMap<usize, Master<O, H>>,
    /// One flat master per chunk stepped whole, by chunk id.
    by_chunk: BTreeMap<usize, Master<O, H>>,
}

impl<O: SimpleOptimizer<H>, H: Backend> Default for Masters<O, H> {
    fn default() -> Self {
        Self {
            by_param: BTreeMap::new(),
            by_chunk: BTreeMap::new(),
        }
    }
}

impl<O: SimpleOptimizer<H>, H: Backend> Clone for Masters<O, H> {
    fn clone(&self) -> Self {
        Self {
            by_param: self.by_param.clone(),
            by_chunk: self.by_chunk.clone(),
        }
    }
}

impl<O: SimpleOptimizer<H>, H: Backend> Masters<O, H> {
    /// Per-parameter entries (a record's): chunks' masters are joined from them at their
    /// first step.
    pub(crate) fn from_entries(entries: impl IntoIterator<Item = (usize, Master<O, H>)>) -> Self {
        Self {
            by_param: entries.into_iter().collect(),
            by_chunk: BTreeMap::new(),
        }
    }

    /// Every master, per parameter and per chunk.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Master<O, H>> {
        self.by_param.values().chain(self.by_chunk.values())
    }

    /// Parameter `key`'s own master, when it has one.
    pub(crate) fn of_param(&self, key: usize) -> Option<&Master<O, H>> {
        self.by_param.get(&key)
    }

    /// Chunk `id`'s flat master, when it has one.
    pub(crate) fn of_chunk(&self, id: usize) -> Option<&Master<O, H>> {
        self.by_chunk.get(&id)
    }

    /// Parameter `key`'s own master, made by `make` the first time.
    pub(crate) fn param_or_make(
        &mut self,
        key: usize,
        make: impl FnOnce() -> Master<O, H>,
    ) -> &mut Master<O, H> {
        self.by_param.entry(key).or_insert_with(make)
    }

    /// `chunk`'s flat master: kept from the last step, joined from its members' restored
    /// entries when every member has one, or made by `make`.
    ///
    /// # Panics
    /// When the members' restored states cannot be joined (some have state and others none,
    /// or their records differ in shape).
    pub(crate) fn chunk_or_make(
        &mut self,
        chunk: &Chunk,
        make: impl FnOnce() -> Master<O, H>,
    ) -> &mut Master<O, H> {
        if !self.by_chunk.contains_key(&chunk.id) {
            let master = self.join_restored(chunk).unwrap_or_else(make);
            self.by_chunk.insert(chunk.id, master);
        }
        self.by_chunk.get_mut(&chunk.id).expect("made above")
    }

    /// Takes parameter `key`'s own master out (it moves to the other side).
    pub(crate) fn take_param(&mut self, key: usize) -> Option<Master<O, H>> {
        self.by_param.remove(&key)
    }

    /// Takes chunk `id`'s flat master out (it moves to the other side).
    pub(crate) fn take_chunk(&mut self, id: usize) -> Option<Master<O, H>> {
        self.by_chunk.remove(&id)
    }

    /// Adds parameter `key`'s master (moved from the other side).
    pub(crate) fn put_param(&mut self, key: usize, master: Master<O, H>) {
        self.by_param.insert(key, master);
    }

    /// Adds chunk `id`'s flat master (moved from the other side).
    pub(crate) fn put_chunk(&mut self, id: usize, master: Master<O, H>) {
        self.by_chunk.insert(id, master);
    }

    /// Parameter `key`'s fp32 values: its own master's, or its part of its chunk's in
    /// `layout`.
    pub(crate) fn values_of(
        &self,
        key: usize,
        layout: Option<&ChunkLayout>,
    ) -> Option<Tensor<H, 1>> {
        if let Some(master) = self.by_param.get(&key) {
            return Some(master.values.clone());
        }
        let (chunk, index) = layout?.place(key)?;
        let master = self.by_chunk.get(&chunk.id)?;
        let member = &chunk.members[index];
        Some(
            master
                .values
                .clone()
                .slice(member.offset..member.offset + member.block_len),
        )
    }

    /// Every parameter's entry for a record, by key: the parameters' own masters, and the
    /// chunks' masters (of `layout`) split at their members' boundaries.
    ///
    /// # Panics
    /// When a chunk's optimizer state cannot be split into its parameters'.
    pub(crate) fn entries(&self, layout: Option<&ChunkLayout>) -> Vec<(usize, Master<O, H>)> {
        let mut entries: Vec<(usize, Master<O, H>)> = self
            .by_param
            .iter()
            .map(|(&key, master)| (key, master.clone()))
            .collect();
        if let Some(layout) = layout {
            for (&id, master) in &self.by_chunk {
                if let Some(chunk) = layout.chunks().get(id) {
                    entries.extend(split(chunk, master));
                }
            }
        }
        entries.sort_by_key(|(key, _)| *key);
        entries
    }

    /// The chunk's master joined from its members' per-parameter entries (a restored record),
    /// when every member has one.
    fn join_restored(&mut self, chunk: &Chunk) -> Option<Master<O, H>> {
        if !chunk
            .members
            .iter()
            .all(|m| self.by_param.contains_key(&m.key))
        {
            return None;
        }
        let parts: Vec<Master<O, H>> = chunk
            .members
            .iter()
            .map(|m| self.by_param.remove(&m.key).expect("checked above"))
            .collect();
        let device = parts[0].values.device();
        let lens: Vec<usize> = parts.iter().map(|p| p.values.dims()[0]).collect();
        let values = Tensor::cat(parts.iter().map(|p| p.values.clone()).collect(), 0);
        let state = match parts.iter().filter(|p| p.state.is_some()).count() {
            0 => None,
            n if n == parts.len() => {
                let states = parts
                    .into_iter()
                    .zip(&lens)
                    .map(|(p, &len)| (p.state.expect("counted"), len))
                    .collect();
                Some(
                    join_states::<H, O::State<1>>(states, &device).unwrap_or_else(|reason| {
                        panic!(
                            "burn-zero: the restored optimizer state of chunk #{} cannot be \
                             joined: {reason}",
                            chunk.id
                        )
                    }),
                )
            }
            _ => panic!(
                "burn-zero: some parameters of chunk #{} have optimizer state and others none; \
                 a chunk's parameters are stepped together",
                chunk.id
            ),
        };
        Some(Master { values, state })
    }
}

/// `chunk`'s flat `master` as its members' entries: values and state split at the members'
/// boundaries.
fn split<O: SimpleOptimizer<H>, H: Backend>(
    chunk: &Chunk,
    master: &Master<O, H>,
) -> Vec<(usize, Master<O, H>)> {
    let lens: Vec<usize> = chunk.members.iter().map(|m| m.block_len).collect();
    let len = master.values.dims()[0];
    let states = master.state.clone().map(|state| {
        let device = master.values.device();
        split_state::<H, O::State<1>>(state, len, &lens, &device).unwrap_or_else(|reason| {
            panic!(
                "burn-zero: the optimizer state of chunk #{} cannot be split into its \
                 parameters': {reason}",
                chunk.id
            )
        })
    });
    let mut entries = Vec::with_capacity(lens.len());
    let mut start = 0;
    for (i, member) in chunk.members.iter().enumerate() {
        let values = master.values.clone().slice(start..start + lens[i]);
        let state = states.as_ref().map(|s| s[i].clone());
        entries.push((member.key, Master { values, state }));
        start += lens[i];
    }
    entries
}
