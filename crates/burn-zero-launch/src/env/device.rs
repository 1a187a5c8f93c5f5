//! Which of the devices this process can see is its own.
//!
//! The local rank is the device index only when every device of the node is visible to every
//! rank (zero-run, torchrun, `mpirun`, `srun` without GPU binding). Schedulers that bind
//! devices per task (`srun --gpus-per-task=1`, jsrun resource sets, a pod's one GPU) show each
//! process only its own, as device 0, whatever its local rank.

/// Why no device can be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceChoiceError {
    /// The process sees no device at all.
    #[error(
        "no device is visible to this process (check CUDA_VISIBLE_DEVICES and the GPUs the \
         scheduler gave this task)"
    )]
    NoDevice,
    /// Fewer devices than this node's ranks, and more than one: neither one device per task
    /// nor every device of the node.
    #[error(
        "local rank {local_rank}{} sees {visible} devices: give each rank exactly one device \
         (as --gpus-per-task=1 does) or every rank all the node's devices, one per rank \
         (check CUDA_VISIBLE_DEVICES)",
        local_world_size.map(|n| format!(" of {n} on this node")).unwrap_or_default()
    )]
    Ambiguous {
        /// Devices visible to this process.
        visible: usize,
        /// This rank's local rank.
        local_rank: usize,
        /// Ranks on this node, when the launcher said.
        local_world_size: Option<usize>,
    },
}

/// The index of this rank's device among the `visible` ones: device 0 when the process sees
/// exactly one (a scheduler bound it to this task), else `local_rank` when the process sees a
/// device for each rank of its node. Anything else is [`DeviceChoiceError`].
pub fn choose_device(
    visible: usize,
    local_rank: usize,
    local_world_size: Option<usize>,
) -> Result<usize, DeviceChoiceError> {
    let enough = local_world_size
        .unwrap_or(local_rank + 1)
        .max(local_rank + 1);
    match visible {
        0 => Err(DeviceChoiceError::NoDevice),
        1 => Ok(0),
        _ if visible >= enough => Ok(local_rank),
        _ => Err(DeviceChoiceError::Ambiguous {
            visible,
            local_rank,
            local_world_size,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_visible_device_is_this_tasks_own() {
        for local_rank in 0..8 {
            assert_eq!(choose_device(1, local_rank, Some(8)), Ok(0));
            assert_eq!(choose_device(1, local_rank, None), Ok(0));
        }
    }

    #[test]
    fn every_device_visible_means_the_local_rank() {
        for local_rank in 0..8 {
            assert_eq!(choose_device(8, local_rank, Some(8)), Ok(local_rank));
            assert_eq!(choose_device(8, local_rank, None), Ok(local_rank));
        }
        // More devices than ranks on the node: still one each.
        assert_eq!(choose_device(8, 3, Some(4)), Ok(3));
    }

    #[test]
    fn other_layouts_are_refused() {
        assert_eq!(
            choose_device(0, 0, Some(1)),
            Err(DeviceChoiceError::NoDevice)
        );
        let error = choose_device(2, 1, Some(8)).unwrap_err();
        assert_eq!(
            error,
            DeviceChoiceError::Ambiguous {
                visible: 2,
                local_rank: 1,
                local_world_size: Some(8)
            }
        );
        assert!(
            error
                .to_string()
                .starts_with("local rank 1 of 8 on this node sees 2 devices"),
            "{error}"
        );
        // Without a local world size, only the local rank's own index must exist.
        assert!(choose_device(2, 2, None).is_err());
        assert_eq!(choose_device(3, 2, None), Ok(2));
    }
}
