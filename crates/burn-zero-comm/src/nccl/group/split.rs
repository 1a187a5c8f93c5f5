//! New groups from a group: duplicates over the same ranks and splits into subgroups, each
//! with its own NCCL communicator and stream, in the same family as the group they came from.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::CubeBackend;
use cubecl_cuda::CudaRuntime;

use super::{Group, Kind, Link, NcclGroup};
use crate::call::CollectiveOp;
use crate::control::JobControl;
use crate::error::CommError;
use crate::nccl::family::Lineage;
use crate::nccl::sys::{self, Failure, Progress, RawComm};

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
        let call = self.call(CollectiveOp::Duplicate, None, 0);
        if let Some(control) = &self.control
            && let Err(error) = control.check(&call)
        {
            let mut link = self.lock();
            return Err(self.fail(&mut link, error));
        }
        let during = call.to_string();
        let during = during.as_str();
        let version = sys::version().map_err(|f| {
            let mut link = self.lock();
            self.fail(&mut link, self.nccl_error(during, f))
        })?;
        if version >= sys::SPLIT_VERSION {
            let mut link = self.lock();
            self.bind(&mut link)?;
            let started = Instant::now();
            let split = self
                .usable(&mut link)?
                .split(0, self.rank, started, self.options.timeout);
            let (child, progress) = self.split_started(&mut link, split, started, during)?;
            drop(link);
            let child = crate::nccl::setup::finish_init(
                self.rank,
                child,
                progress,
                started,
                self.options.timeout,
                during,
            )
            .map_err(|error| {
                let mut link = self.lock();
                self.fail(&mut link, error)
            })?;
            return self.duplicate_around(child, call.seq);
        }
        // Older NCCL: rank 0 makes an id and broadcasts it over this group.
        let mut id = [0u8; sys::UNIQUE_ID_BYTES];
        if self.rank == 0 {
            id = sys::unique_id().map_err(|f| {
                let mut link = self.lock();
                self.fail(&mut link, self.nccl_error(during, f))
            })?;
        }
        let floats: Vec<f32> = id.iter().map(|&b| b as f32).collect();
        let tensor = Tensor::<CubeBackend<CudaRuntime, f32, i32, u8>, 1>::from_floats(
            floats.as_slice(),
            &self.device,
        );
        let shared = self.run(
            CollectiveOp::Broadcast { root: 0 },
            tensor.into_primitive().tensor(),
            Kind::Broadcast(0),
        )?;
        let shared = Tensor::<CubeBackend<CudaRuntime, f32, i32, u8>, 1>::from_primitive(
            TensorPrimitive::Float(shared),
        )
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| CommError::Device {
            rank: self.rank,
            reason: format!("{e:?}"),
        })?;
        for (byte, value) in id.iter_mut().zip(shared) {
            *byte = value as u8;
        }
        let child = crate::nccl::setup::init_comm(
            self.rank,
            self.world_size,
            &self.context,
            &id,
            &self.options,
        )
        .map_err(|error| {
            let mut link = self.lock();
            self.fail(&mut link, error)
        })?;
        self.duplicate_around(child, call.seq)
    }

    /// A duplicate of this group around its new communicator `child`, made by this group's
    /// call number `seq`: the same ranks, device, options and family, with its own stream and
    /// a control connection for aborts only.
    fn duplicate_around(&self, child: RawComm, seq: u64) -> Result<NcclGroup, CommError> {
        Group::new(
            self.rank,
            self.world_size,
            self.device.clone(),
            self.options.clone(),
            self.context.clone(),
            child,
            self.family.clone(),
            self.descendant((seq, None)),
            self.duplicate_control(),
        )
        .map(NcclGroup::from)
    }

    /// A new group of the ranks of this one that pass the same `color`, ranked in their order
    /// here, with its own NCCL communicator and stream (`ncclCommSplit`, NCCL 2.18 and later).
    /// Collective: every rank must call it as its next call on this group. The ranks first
    /// gather each other's colors over this group (to know the new group's size and their
    /// rank in it); a failure of either group ends the other too. The same ordering rule as
    /// for [`NcclGroup::duplicate_group`] holds between the two groups.
    pub fn split_group(&self, color: usize) -> Result<NcclGroup, CommError> {
        let call = self.call(CollectiveOp::Split, None, 0);
        if let Some(control) = &self.control
            && let Err(error) = control.check(&call)
        {
            let mut link = self.lock();
            return Err(self.fail(&mut link, error));
        }
        let during = call.to_string();
        let during = during.as_str();
        let version = sys::version().map_err(|f| {
            let mut link = self.lock();
            self.fail(&mut link, self.nccl_error(during, f))
        })?;
        if version < sys::SPLIT_VERSION {
            let mut link = self.lock();
            let error = CommError::InvalidGroup(format!(
                "splitting a group needs NCCL 2.18 or later (ncclCommSplit); the loaded NCCL is \
                 version code {version}"
            ));
            return Err(self.fail(&mut link, error));
        }
        // Every rank's color, exactly representable in f32 below 2^24.
        if color >= 1 << 24 {
            let mut link = self.lock();
            let error = CommError::InvalidGroup(format!(
                "split color {color} is too large (at most {})",
                (1 << 24) - 1
            ));
            return Err(self.fail(&mut link, error));
        }
        let mine = Tensor::<CubeBackend<CudaRuntime, f32, i32, u8>, 1>::from_floats(
            [color as f32],
            &self.device,
        );
        let colors = self.run(
            CollectiveOp::AllGather,
            mine.into_primitive().tensor(),
            Kind::AllGather,
        )?;
        let colors = Tensor::<CubeBackend<CudaRuntime, f32, i32, u8>, 1>::from_primitive(
            TensorPrimitive::Float(colors),
        )
        .into_data()
        .to_vec::<f32>()
        .map_err(|e| CommError::Device {
            rank: self.rank,
            reason: format!("{e:?}"),
        })?;
        let members: Vec<usize> = (0..self.world_size)
            .filter(|&r| colors[r] == color as f32)
            .collect();
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .unwrap_or_else(|| unreachable!("a rank is a member of its own color"));
        let mut link = self.lock();
        self.bind(&mut link)?;
        let started = Instant::now();
        let split = self
            .usable(&mut link)?
            .split(color, self.rank, started, self.options.timeout);
        let (child, progress) = self.split_started(&mut link, split, started, during)?;
        drop(link);
        let child = crate::nccl::setup::finish_init(
            rank,
            child,
            progress,
            started,
            self.options.timeout,
            during,
        )
        .map_err(|error| {
            let mut link = self.lock();
            self.fail(&mut link, error)
        })?;
        let mut group = Group::new(
            rank,
            members.len(),
            self.device.clone(),
            self.options.clone(),
            self.context.clone(),
            child,
            self.family.clone(),
            self.descendant((call.seq, Some(color))),
            self.duplicate_control(),
        )?;
        group.job_rank = self.job_rank;
        Ok(NcclGroup::from(group))
    }

    /// The control connection of a duplicate: the same connection, aborts only (a duplicate
    /// counts its collectives apart, so its positions are not comparable with the store's).
    fn duplicate_control(&self) -> Option<Arc<JobControl>> {
        self.control
            .as_ref()
            .map(|control| Arc::new(control.without_checks()))
    }

    /// The communicator a split started, or the group ended with why it did not: NCCL's
    /// failure, or the parent still busy with it when the group's timeout ran out.
    fn split_started(
        &self,
        link: &mut Link,
        split: Result<sys::Split, Failure>,
        started: Instant,
        during: &str,
    ) -> Result<(RawComm, Progress), CommError> {
        match split {
            Ok(sys::Split::Started(child, progress)) => Ok((child, progress)),
            Ok(sys::Split::Stalled) => {
                let stalled = CommError::Stalled {
                    rank: self.rank,
                    during: during.to_string(),
                    waited: started.elapsed(),
                };
                Err(self.fail(link, stalled))
            }
            Err(failure) => Err(self.fail(link, self.nccl_error(during, failure))),
        }
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
