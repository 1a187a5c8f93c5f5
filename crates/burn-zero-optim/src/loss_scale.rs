//! Dynamic loss scaling for half-precision training: the loss is multiplied by a scale before
//! backward so that small gradients survive f16; an overflow (inf/NaN in any rank's gradient)
//! skips the step and, after `hysteresis` overflows, shrinks the scale; `growth_interval`
//! clean steps in a row grow it.

use burn::config::Config;

/// The knobs of [`DynamicLossScaler`], with ColossalAI's defaults and meaning.
#[derive(Config, Debug, PartialEq)]
pub struct LossScalerConfig {
    /// The scale to start with.
    #[config(default = 65536.0)]
    pub initial_scale: f64,
    /// The scale never goes below this.
    #[config(default = 1.0)]
    pub min_scale: f64,
    /// The scale never goes above this.
    #[config(default = 4294967296.0)]
    pub max_scale: f64,
    /// Factor applied when the scale grows.
    #[config(default = 2.0)]
    pub growth_factor: f64,
    /// Factor applied when the scale backs off.
    #[config(default = 0.5)]
    pub backoff_factor: f64,
    /// Clean steps in a row after which the scale grows.
    #[config(default = 1000)]
    pub growth_interval: usize,
    /// Overflows (since the scale last grew or backed off) it takes to back off.
    #[config(default = 2)]
    pub hysteresis: usize,
}

/// The loss scale and its update rule.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    config: LossScalerConfig,
    scale: f64,
    clean_steps: usize,
    overflows: usize,
}

impl DynamicLossScaler {
    /// A scaler at `config.initial_scale`.
    pub fn new(config: LossScalerConfig) -> Self {
        Self {
            scale: config
                .initial_scale
                .clamp(config.min_scale, config.max_scale),
            config,
            clean_steps: 0,
            overflows: 0,
        }
    }

    /// The state that changes from step to step: scale, clean steps, overflows.
    pub(crate) fn state(&self) -> (f64, usize, usize) {
        (self.scale, self.clean_steps, self.overflows)
    }

    /// Restores a state taken with `state`.
    pub(crate) fn set_state(&mut self, (scale, clean_steps, overflows): (f64, usize, usize)) {
        self.scale = scale;
        self.clean_steps = clean_steps;
        self.overflows = overflows;
    }

    /// The current scale: multiply the loss by it before `backward`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Records a step's outcome and adjusts the scale.
    pub fn update(&mut self, overflow: bool) {
        if overflow {
            self.clean_steps = 0;
            self.overflows += 1;
            if self.overflows >= self.config.hysteresis {
                self.overflows = 0;
                self.scale = (self.scale * self.config.backoff_factor).max(self.config.min_scale);
            }
        } else {
            self.clean_steps += 1;
            if self.clean_steps >= self.config.growth_interval {
                self.clean_steps = 0;
                self.overflows = 0;
                self.scale = (self.scale * self.config.growth_factor).min(self.config.max_scale);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_after_hysteresis_overflows_and_grows_after_the_interval() {
        let mut scaler = DynamicLossScaler::new(
            LossScalerConfig::new()
                .with_initial_scale(1024.0)
                .with_growth_interval(3)
                .with_hysteresis(2)
                .with_min_scale(256.0)
                .with_max_scale(4096.0),
        );
        scaler.update(true);
        assert_eq!(
            scaler.scale(),
            1024.0,
            "one overflow is absorbed by hysteresis"
        );
        scaler.update(true);
        assert_eq!(scaler.scale(), 512.0);
        scaler.update(true);
        scaler.update(true);
        assert_eq!(scaler.scale(), 256.0);
        scaler.update(true);
        scaler.update(true);
        assert_eq!(scaler.scale(), 256.0, "never below min_scale");
        for _ in 0..2 {
            scaler.update(false);
        }
        assert_eq!(scaler.scale(), 256.0);
        scaler.update(false);
        assert_eq!(
            scaler.scale(),
            512.0,
            "grows after growth_interval clean steps"
        );
        for _ in 0..9 {
            scaler.update(false);
        }
        assert_eq!(scaler.scale(), 4096.0, "never above max_scale");
        // An overflow resets the clean-step count.
        let mut scaler = DynamicLossScaler::new(
            LossScalerConfig::new()
                .with_initial_scale(8.0)
                .with_growth_interval(2)
                .with_hysteresis(1),
        );
        scaler.update(false);
        scaler.update(true);
        assert_eq!(scaler.scale(), 4.0);
        scaler.update(false);
        assert_eq!(scaler.scale(), 4.0);
        scaler.update(false);
        assert_eq!(scaler.scale(), 8.0);
    }
}
