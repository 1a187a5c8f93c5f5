//! `ZeroConfig`: how a module is sharded.

use burn::config::Config;

/// How [`crate::shard`] partitions a module and how the decorator gathers it.
///
/// A Burn [`Config`]: it serialises to JSON (`save`/`load`) and builds with `ZeroConfig::new()`
/// plus `with_*` setters.
#[derive(Config, Debug, PartialEq)]
pub struct ZeroConfig {
    /// ZeRO stage. Stage 3 partitions parameters, gradients and optimizer state. (Stages 0–2
    /// arrive with the gradient bucketer.)
    #[config(default = 3)]
    pub stage: u8,
    /// Parameters with fewer elements than this stay replicated on every rank (their gradients
    /// are all-reduced, not reduce-scattered): gathering tiny tensors costs more in latency than
    /// it saves in memory. DeepSpeed's `stage3_param_persistence_threshold` plays the same role.
    #[config(default = 100_000)]
    pub persist_below_numel: usize,
    /// Upper bound of gathered full parameters kept alive between ops, in bytes. A parameter
    /// used several times in one pass (tied embeddings) is then gathered once. Parameters that
    /// do not fit are gathered for one op and dropped. 0 disables the cache.
    #[config(default = 536_870_912)]
    pub max_live_gathered_bytes: usize,
    /// Copy rank 0's values to every rank while sharding, so that ranks whose models were
    /// initialised differently still start from one model (FSDP's `sync_module_states`).
    #[config(default = true)]
    pub sync_module_states: bool,
}
