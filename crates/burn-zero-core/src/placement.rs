//! `Placement`: where each chunk's parameter shards and optimizer state live, device or host
//! memory, as one value (ColossalAI Gemini's `placement_policy` with its fractions and
//! `gpu_margin_mem_ratio`; DeepSpeed's `offload_param` and `offload_optimizer`).
//!
//! `shard` places the parameter shards; the optimizer built from the sharded module's state
//! places its fp32 masters and optimizer state chunk by chunk, on the device or on the host
//! backend it was given, and steps each chunk where it lives.

use serde::{Deserialize, Serialize};

/// Where model state lives (`ZeroConfig::placement`). The default keeps everything on the
/// device.
///
/// Two policies, as Gemini's:
/// - static (`auto` is `None`): fixed fractions of the chunks' bytes in host memory, whole
///   chunks in layout order;
/// - auto (`auto` is the device capacity to plan for), stage 3: parameter shards placed by
///   measurement. The first two passes (the warm-up) run with every shard in host memory while
///   the device's bytes in use are read; then the shards of chunks in layout order move to the
///   device while they fit in 0.9 × capacity less the warm-up's peak and one chunk's shard,
///   and the others' shards stay on the device between their gathers while each period of the
///   step has room (the one used furthest ahead evicted first). Needs a backend whose memory
///   cubecl reports (wgpu, CUDA).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// The auto policy's device capacity; `None` for the static policy.
    pub auto: Option<Capacity>,
    /// Static policy, stage 3: the fraction (0 to 1) of the sharded chunks' bytes whose
    /// parameter shards live in host memory; an offloaded shard is uploaded for each
    /// all-gather and the upload freed with the gathered parameter.
    pub offload_param_frac: f64,
    /// The fraction (0 to 1) of the trainable chunks' bytes whose fp32 masters and optimizer
    /// state live on the optimizer's host backend and step there; their gradient shards are
    /// read back to host memory during backward.
    pub offload_optim_frac: f64,
    /// Auto policy: once the placement has decided, host chunks' optimizer state moves to the
    /// device, in layout order, while it fits in this fraction (0 to 1) of the device memory
    /// the placement left over, and steps there (Gemini's `gpu_margin_mem_ratio`).
    pub gpu_margin_mem_ratio: f64,
}

/// The device memory the auto placement plans for.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Capacity {
    /// This many MiB.
    MiB(f64),
    /// What the device reports when the model is sharded: on CUDA, the memory the driver
    /// reports free then plus the bytes cubecl already holds reserved there. Other backends
    /// report no capacity: `shard` refuses it there, naming `Capacity::MiB`.
    Device,
}

impl Placement {
    /// Everything on the device (the default).
    pub fn device() -> Self {
        Placement::default()
    }

    /// The static policy: `offload_param_frac` of the sharded chunks' parameter shards and
    /// `offload_optim_frac` of the trainable chunks' optimizer state in host memory.
    pub fn fractions(offload_param_frac: f64, offload_optim_frac: f64) -> Self {
        Placement {
            offload_param_frac,
            offload_optim_frac,
            ..Placement::default()
        }
    }

    /// The auto policy under `capacity`, with the optimizer state on the host backend, as
    /// Gemini's (set a margin with [`Placement::with_gpu_margin_mem_ratio`], or keep some state
    /// on the device with [`Placement::with_offload_optim_frac`]).
    pub fn auto(capacity: Capacity) -> Self {
        Placement {
            auto: Some(capacity),
            offload_optim_frac: 1.0,
            ..Placement::default()
        }
    }

    /// The same placement with `fraction` of the parameter shards in host memory.
    pub fn with_offload_param_frac(self, fraction: f64) -> Self {
        Placement {
            offload_param_frac: fraction,
            ..self
        }
    }

    /// The same placement with `fraction` of the optimizer state on the host backend.
    pub fn with_offload_optim_frac(self, fraction: f64) -> Self {
        Placement {
            offload_optim_frac: fraction,
            ..self
        }
    }

    /// The same placement with the margin ratio `ratio` (auto policy only).
    pub fn with_gpu_margin_mem_ratio(self, ratio: f64) -> Self {
        Placement {
            gpu_margin_mem_ratio: ratio,
            ..self
        }
    }

    /// Whether every shard, master and state stays on the device.
    pub fn all_on_device(&self) -> bool {
        self.auto.is_none() && self.offload_param_frac == 0.0 && self.offload_optim_frac == 0.0
    }

    /// Checks the values that cannot work at `stage`; the message names the field.
    pub fn validate(&self, stage: u8) -> Result<(), String> {
        for (name, value) in [
            ("offload_param_frac", self.offload_param_frac),
            ("offload_optim_frac", self.offload_optim_frac),
            ("gpu_margin_mem_ratio", self.gpu_margin_mem_ratio),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(format!(
                    "{name} must be a fraction from 0 to 1, not {value}"
                ));
            }
        }
        if self.offload_param_frac > 0.0 && stage != 3 {
            return Err(format!(
                "offload_param_frac needs stage 3 (parameters sharded and gathered at use), not \
                 stage {stage}"
            ));
        }
        let Some(capacity) = self.auto else {
            if self.gpu_margin_mem_ratio > 0.0 {
                return Err(
                    "gpu_margin_mem_ratio shares out the device memory the auto placement leaves \
                     over: it needs the auto placement (`Placement::auto`)"
                        .into(),
                );
            }
            return Ok(());
        };
        if let Capacity::MiB(mib) = capacity
            && !(mib.is_finite() && mib > 0.0)
        {
            return Err(format!(
                "the auto placement's capacity must be a positive number of MiB, not {mib}"
            ));
        }
        if stage != 3 {
            return Err(format!(
                "the auto placement needs stage 3 (parameters sharded and gathered at use), not \
                 stage {stage}"
            ));
        }
        if self.offload_param_frac > 0.0 {
            return Err(format!(
                "the auto placement places parameter shards by measurement; offload_param_frac \
                 {} would place them by fraction: set one of the two",
                self.offload_param_frac
            ));
        }
        if self.gpu_margin_mem_ratio > 0.0 && self.offload_optim_frac == 0.0 {
            return Err(
                "gpu_margin_mem_ratio moves optimizer state from the host to the device, and \
                 offload_optim_frac 0 leaves none on the host: raise offload_optim_frac (1 lets \
                 the margin choose among every chunk)"
                    .into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_are_named() {
        let refused = |placement: Placement, stage: u8| placement.validate(stage).unwrap_err();
        assert!(refused(Placement::fractions(1.5, 0.0), 3).contains("offload_param_frac"));
        assert!(refused(Placement::fractions(0.0, f64::NAN), 3).contains("offload_optim_frac"));
        assert!(refused(Placement::fractions(0.5, 0.0), 2).contains("needs stage 3"));
        let auto = Placement::auto(Capacity::MiB(256.0));
        assert!(refused(auto.with_gpu_margin_mem_ratio(-0.1), 3).contains("gpu_margin"));
        assert!(refused(Placement::auto(Capacity::MiB(0.0)), 3).contains("capacity"));
        assert!(refused(auto, 1).contains("needs stage 3"));
        assert!(refused(auto.with_offload_param_frac(0.5), 3).contains("set one of the two"));
        let no_host = auto
            .with_offload_optim_frac(0.0)
            .with_gpu_margin_mem_ratio(0.5);
        assert!(refused(no_host, 3).contains("offload_optim_frac 0"));
        let margin = Placement::fractions(0.0, 1.0).with_gpu_margin_mem_ratio(0.5);
        assert!(refused(margin, 3).contains("needs the auto placement"));
        assert!(Placement::fractions(0.5, 1.0).validate(3).is_ok());
        assert!(auto.with_gpu_margin_mem_ratio(0.8).validate(3).is_ok());
        assert!(Placement::device().all_on_device());
    }
}
