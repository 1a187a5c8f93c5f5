//! `Groups`: the communicators one rank's sharded state works with — all ranks, the ranks its
//! tensors are sharded over, and (hybrid sharding) the ranks that hold the same shards.
//!
//! Without hybrid sharding the three are one group. With a shard-group size S dividing the N
//! ranks, rank r belongs to shard group r / S (contiguous ranks, one node when ranks are laid
//! out node by node) and to replica group r % S (the ranks of the other shard groups that hold
//! the same blocks). Parameters are gathered inside the shard group; a gradient is
//! reduce-scattered inside it and the resulting block all-reduced across the replica group.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn_zero_comm::{CommError, Communicator, OrderedComm};

/// The communicators of one rank of a sharded module.
pub struct Groups<B: Backend> {
    /// Every rank of the job: the ranks agree on the module, and rank 0's values are
    /// broadcast, over this one.
    pub world: Arc<dyn Communicator<B>>,
    /// The ranks each tensor is sharded over (the world without hybrid sharding).
    pub shard: Arc<dyn Communicator<B>>,
    /// The ranks holding the same blocks in the other shard groups (hybrid sharding only).
    pub replicas: Option<Arc<dyn Communicator<B>>>,
}

impl<B: Backend> Clone for Groups<B> {
    fn clone(&self) -> Self {
        Self {
            world: self.world.clone(),
            shard: self.shard.clone(),
            replicas: self.replicas.clone(),
        }
    }
}

/// The ordered handles of a rank's groups, for the communication thread, which reserves
/// positions on them.
pub(crate) struct OrderedGroups<B: Backend> {
    pub shard: OrderedComm<B>,
    pub replicas: Option<OrderedComm<B>>,
}

impl<B: Backend> Groups<B> {
    /// One group of every rank.
    pub fn single(world: Arc<dyn Communicator<B>>) -> Self {
        Self {
            shard: world.clone(),
            world,
            replicas: None,
        }
    }

    /// Splits `world` into shard groups of `shard_size` contiguous ranks and the replica
    /// groups across them (a collective: two splits). `shard_size` equal to the world size
    /// splits nothing.
    pub fn split(world: Arc<dyn Communicator<B>>, shard_size: usize) -> Result<Self, CommError> {
        let (rank, size) = (world.rank(), world.world_size());
        check(size, shard_size)?;
        if shard_size == size {
            return Ok(Self::single(world));
        }
        let shard = world.split(rank / shard_size)?;
        let replicas = world.split(rank % shard_size)?;
        Ok(Self {
            world,
            shard,
            replicas: Some(replicas),
        })
    }

    /// [`Self::split`] behind a rank's issuing thread: the groups' collectives keep the rank's
    /// one order, and the ordered handles come back for the communication thread.
    pub(crate) fn split_ordered(
        world: &OrderedComm<B>,
        shard_size: usize,
    ) -> Result<(Self, OrderedGroups<B>), CommError> {
        let (rank, size) = (world.rank(), world.world_size());
        check(size, shard_size)?;
        let world_comm: Arc<dyn Communicator<B>> = Arc::new(world.clone());
        if shard_size == size {
            let ordered = OrderedGroups {
                shard: world.clone(),
                replicas: None,
            };
            return Ok((Self::single(world_comm), ordered));
        }
        let shard = world.split_ordered(rank / shard_size)?;
        let replicas = world.split_ordered(rank % shard_size)?;
        let groups = Self {
            world: world_comm,
            shard: Arc::new(shard.clone()),
            replicas: Some(Arc::new(replicas.clone())),
        };
        let ordered = OrderedGroups {
            shard,
            replicas: Some(replicas),
        };
        Ok((groups, ordered))
    }

    /// This rank's shard group (0-based) and the number of shard groups.
    pub fn replica(&self) -> (usize, usize) {
        match &self.replicas {
            Some(replicas) => (replicas.rank(), replicas.world_size()),
            None => (0, 1),
        }
    }
}

fn check(world_size: usize, shard_size: usize) -> Result<(), CommError> {
    if shard_size == 0 || !world_size.is_multiple_of(shard_size) {
        return Err(CommError::InvalidGroup(format!(
            "shard groups of {shard_size} ranks cannot split {world_size} ranks evenly"
        )));
    }
    Ok(())
}
