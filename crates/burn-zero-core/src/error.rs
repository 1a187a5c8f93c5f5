//! Errors of sharding and of the decorator.

use burn_zero_comm::CommError;

/// Why sharding or unsharding a module failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ZeroError {
    /// A collective failed (another rank failed, schedules diverged, a timeout).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The ranks' modules do not have the same parameters.
    #[error("ranks disagree on the model's parameters: {0}")]
    ModuleMismatch(String),
    /// A configuration that cannot work.
    #[error("invalid ZeroConfig: {0}")]
    InvalidConfig(String),
    /// The auto placement was asked to read the device's capacity and its driver could not
    /// report it.
    #[error("the auto placement could not read the device's capacity: {0}")]
    DeviceCapacity(#[from] burn_zero_comm::CapacityError),
    /// A module that is already sharded.
    #[error("parameter {0} is already sharded")]
    AlreadySharded(String),
    /// The optimizer cannot be made as asked (its configuration, or the placement).
    #[error("optimizer: {0}")]
    Optimizer(String),
}
