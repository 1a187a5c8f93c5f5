//! New groups from a group: duplicates over the same ranks and splits into subgroups, each
//! with its own NCCL communicator and stream, in the same family as the group they came from.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;

use super::{Group, Kind, NcclGroup};
use crate::call::{CollectiveCall, CollectiveOp};
use crate::error::CommError;
use crate::nccl::family::Lineage;
use crate::nccl::setup::{finish_init, init_comm};
use crate::nccl::sys::{self, RawComm};

/// The tensors the groups exchange their ids and colors in.
type Floats = Tensor<CubeBackend<CudaRuntime, f32, i32, u8>, 1>;

impl NcclGroup {
    /// A new group over the same ranks, in the same order, with its own NCCL communicator and
    /// stream (`ncclCommSplit` on NCCL 2.18 and later, otherwise a fresh unique id broadcast
    /// over this group). Collective: every rank must call it as its next call on this group. A
    /// failure of either group ends the other too (see [`crate::Communicator::duplicate`]).
    ///
    /// As with any two NCCL communicators over the same GPUs, every rank must issue the
    /// collectives of both in the same relative order; NCCL may deadlock otherwise (a collective
    /// of one waits on the GPU for a peer that is blocked in the other).
    pub fn duplicate_group(&self) -> Result<NcclGroup, CommError> {
        let (call, version) = self.begin(CollectiveOp::Duplicate)?;
        let during = call.to_string();
        let child = if version >= sys::SPLIT_VERSION {
            self.split_comm(0, self.rank, &during)?
        } else {
            // Older NCCL: rank 0 makes an id and broadcasts it over this group.
            let mut id = [0u8; sys::UNIQUE_ID_BYTES];
            if self.rank == 0 {
                id = sys::unique_id()
                    .map_err(|f| self.fail_unlocked(self.nccl_error(&during, f)))?;
            }
            let floats: Vec<f32> = id.iter().map(|&b| b as f32).collect();
            let tensor = Floats::from_floats(floats.as_slice(), &self.device);
            let shared = self.run(
                CollectiveOp::Broadcast { root: 0 },
                tensor.into_primitive().tensor(),
                Kind::Broadcast(0),
            )?;
            for (byte, value) in id.iter_mut().zip(self.read_floats(shared)?) {
                *byte = value as u8;
            }
            init_comm(
                self.rank,
                self.world_size,
                &self.context,
                &id,
                &self.options,
            )
            .map_err(|error| self.fail_unlocked(error))?
        };
        self.child(self.rank, self.world_size, child, (call.seq, None))
    }

    /// A new group of the ranks of this one that pass the same `color`, ranked in their order
    /// here, with its own NCCL communicator and stream (`ncclCommSplit`, NCCL 2.18 and later).
    /// Collective: every rank must call it as its next call on this group. The ranks first
    /// gather each other's colors over this group (to know the new group's size and their
    /// rank in it); a failure of either group ends the other too. The same ordering rule as
    /// for [`NcclGroup::duplicate_group`] holds between the two groups.
    pub fn split_group(&self, color: usize) -> Result<NcclGroup, CommError> {
        let (call, version) = self.begin(CollectiveOp::Split)?;
        if version < sys::SPLIT_VERSION {
            return Err(self.fail_unlocked(CommError::InvalidGroup(format!(
                "splitting a group needs NCCL 2.18 or later (ncclCommSplit); the loaded NCCL is \
                 version code {version}"
            ))));
        }
        // Every rank's color, exactly representable in f32 below 2^24.
        if color >= 1 << 24 {
            return Err(self.fail_unlocked(CommError::InvalidGroup(format!(
                "split color {color} is too large (at most {})",
                (1 << 24) - 1
            ))));
        }
        let mine = Floats::from_floats([color as f32], &self.device);
        let colors = self.run(
            CollectiveOp::AllGather,
            mine.into_primitive().tensor(),
            Kind::AllGather,
        )?;
        let colors = self.read_floats(colors)?;
        let members: Vec<usize> = (0..self.world_size)
            .filter(|&r| colors[r] == color as f32)
            .collect();
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .unwrap_or_else(|| unreachable!("a rank is a member of its own color"));
        let child = self.split_comm(color, rank, &call.to_string())?;
        self.child(rank, members.len(), child, (call.seq, Some(color)))
    }

    /// The first steps of a duplicate or a split: the call's fingerprint, agreed on by every
    /// rank when the job checks its schedule, and the loaded NCCL's version code.
    fn begin(&self, op: CollectiveOp) -> Result<(CollectiveCall, i32), CommError> {
        let call = self.call(op, None, 0);
        self.check_schedule(&call)?;
        let version = sys::version()
            .map_err(|f| self.fail_unlocked(self.nccl_error(&call.to_string(), f)))?;
        Ok((call, version))
    }

    /// A communicator split from this group's (`ncclCommSplit`) for the ranks of `color`, in
    /// which this rank is `rank`, once it has finished initialising; or the group ended with
    /// why not: NCCL's failure, or the parent still busy with it, or the new communicator not
    /// ready, when the group's timeout ran out.
    fn split_comm(&self, color: usize, rank: usize, during: &str) -> Result<RawComm, CommError> {
        let started = Instant::now();
        let (child, progress) = {
            let mut link = self.lock();
            self.bind(&mut link)?;
            let split =
                self.usable(&mut link)?
                    .split(color, self.rank, started, self.options.timeout);
            match split {
                Ok(sys::Split::Started(child, progress)) => (child, progress),
                Ok(sys::Split::Stalled) => {
                    let stalled = CommError::Stalled {
                        rank: self.rank,
                        during: during.to_string(),
                        waited: started.elapsed(),
                    };
                    return Err(self.fail(&mut link, stalled));
                }
                Err(failure) => return Err(self.fail(&mut link, self.nccl_error(during, failure))),
            }
        };
        finish_init(rank, child, progress, started, self.options.timeout, during)
            .map_err(|error| self.fail_unlocked(error))
    }

    /// The group around `child`, a communicator made from this group by `step`, in which
    /// this rank is `rank` of `world_size`: the same device, options, family and job rank,
    /// with its own stream and a control connection for aborts only (its collectives count
    /// apart, so their positions are not comparable with the store's).
    fn child(
        &self,
        rank: usize,
        world_size: usize,
        child: RawComm,
        step: (u64, Option<usize>),
    ) -> Result<NcclGroup, CommError> {
        let control = self
            .control
            .as_ref()
            .map(|control| Arc::new(control.without_checks()));
        let mut group = Group::new(
            rank,
            world_size,
            self.device.clone(),
            self.options.clone(),
            self.context.clone(),
            child,
            self.family.clone(),
            self.descendant(step),
            control,
        )?;
        group.job_rank = self.job_rank;
        Ok(NcclGroup::from(group))
    }

    /// The values of a small f32 tensor this group's collectives returned, read to the host.
    fn read_floats(&self, tensor: CubeTensor<CudaRuntime>) -> Result<Vec<f32>, CommError> {
        Floats::from_primitive(TensorPrimitive::Float(tensor))
            .into_data()
            .to_vec::<f32>()
            .map_err(|e| CommError::Device {
                rank: self.rank,
                reason: format!("{e:?}"),
            })
    }
}

impl Group {
    /// The lineage of a group made from this one by `step`.
    fn descendant(&self, step: (u64, Option<usize>)) -> Lineage {
        let mut lineage = self.lineage.clone();
        lineage.push(step);
        lineage
    }
}
