//! Tests that need hardware or drivers a machine may lack (a CUDA device, a wgpu adapter) call
//! into this module first. When the hardware is absent, the test prints exactly
//! `SKIPPED: <test>: <reason>` and returns, so it passes; CI counts those lines apart from the
//! tests that really ran.
//!
//! A machine that is meant to have the hardware sets `BURN_ZERO_REQUIRE_WGPU=1` or
//! `BURN_ZERO_REQUIRE_CUDA=1`: a missing adapter or device then fails the test instead of
//! skipping it, so a broken driver cannot pass as "skipped".

use std::fmt::Display;
use std::io::Write;

/// The variable that turns a missing wgpu adapter into a failure.
pub const REQUIRE_WGPU: &str = "BURN_ZERO_REQUIRE_WGPU";
/// The variable that turns a missing CUDA device into a failure.
pub const REQUIRE_CUDA: &str = "BURN_ZERO_REQUIRE_CUDA";

/// Says that `test` did not run and why, on the process's standard output.
///
/// The line is written to the stdout handle rather than through `println!`: the test harness
/// captures `println!` of passing tests, and the line must reach the log of every run.
pub fn skip(test: &str, reason: impl Display) {
    let line = format!("SKIPPED: {test}: {reason}\n");
    let mut stdout = std::io::stdout().lock();
    // A closed stdout must not fail the test; there is nowhere left to report to.
    let _ = stdout.write_all(line.as_bytes());
    let _ = stdout.flush();
}

/// Whether `variable` asks for the hardware to be present (set to anything but "", "0").
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn required(variable: &str) -> bool {
    std::env::var(variable).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Skips `test` for `reason`, or fails it when `variable` says the hardware is required.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn absent(test: &str, reason: &str, variable: &str) {
    if required(variable) {
        panic!("{test}: {reason}, and {variable} is set: this machine must have it");
    }
    skip(test, reason);
}

/// Whether wgpu finds an adapter for the graphics API Burn's wgpu backend uses by default
/// (Vulkan on Linux and Windows, Metal on macOS). Without one, Burn's wgpu device panics with
/// "No possible adapter available" on first use; `test` is skipped instead (or fails under
/// `BURN_ZERO_REQUIRE_WGPU=1`).
#[cfg(feature = "wgpu")]
pub fn wgpu_adapter(test: &str) -> bool {
    use std::sync::OnceLock;

    static ADAPTER: OnceLock<Option<String>> = OnceLock::new();
    let adapter = ADAPTER.get_or_init(|| {
        use burn::backend::wgpu::graphics::{AutoGraphicsApi, GraphicsApi};
        let backend = AutoGraphicsApi::backend();
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: backend.into(),
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        // The same request Burn's wgpu runtime makes for its default device.
        let options = wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
        };
        futures_lite::future::block_on(instance.request_adapter(&options))
            .ok()
            .map(|adapter| adapter.get_info().name)
    });
    match adapter {
        Some(_) => true,
        None => {
            absent(
                test,
                "no wgpu adapter (install a Vulkan driver, e.g. Mesa's mesa-vulkan-drivers)",
                REQUIRE_WGPU,
            );
            false
        }
    }
}

/// The number of visible CUDA devices when there are at least `needed`; otherwise `test` is
/// skipped (or fails under `BURN_ZERO_REQUIRE_CUDA=1`, unless the machine has some devices but
/// fewer than `needed`: one GPU cannot run a two-GPU test) and `None` is returned.
///
/// No driver library, or a driver that reports no device, is a skip; any other driver error
/// fails the test, naming the error: a broken driver must not pass as a machine without GPUs.
#[cfg(feature = "cuda")]
pub fn cuda_devices(test: &str, needed: usize) -> Option<usize> {
    let count =
        burn_zero_comm::nccl::cuda_device_count().unwrap_or_else(|error| panic!("{test}: {error}"));
    if count >= needed.max(1) {
        return Some(count);
    }
    if count == 0 {
        absent(test, "no CUDA device visible", REQUIRE_CUDA);
    } else {
        skip(
            test,
            format!("needs {needed} CUDA devices, {count} visible"),
        );
    }
    None
}

/// Whether the device of `test` has `dtype`; when it does not, `test` says it was skipped
/// (naming what it did check instead, if anything) and `false` is returned. A missing dtype is
/// a property of the adapter, not a missing driver, so the `REQUIRE` variables do not apply.
pub fn dtype_supported(
    test: &str,
    supported: bool,
    dtype: impl Display,
    checked_instead: &str,
) -> bool {
    if !supported {
        let also = if checked_instead.is_empty() {
            String::new()
        } else {
            format!(" (checked only {checked_instead})")
        };
        skip(test, format!("this device has no {dtype}{also}"));
    }
    supported
}

/// One `#[test]` per name that says it was skipped because the test binary was built without
/// `feature`: for test files whose tests need a feature to compile, so that a build without it
/// reports them as skipped instead of leaving them out silently.
#[macro_export]
macro_rules! skipped_without_feature {
    ($feature:literal, $($test:ident),+ $(,)?) => {
        $(
            #[test]
            fn $test() {
                $crate::skip::skip(
                    stringify!($test),
                    concat!(
                        "built without the `", $feature, "` feature (cargo test --features ",
                        $feature, ")"
                    ),
                );
            }
        )+
    };
}

/// The names listed by the `skipped_without_feature!` invocation in `source` (a test file's
/// text), for the build with the feature to check them against its tests ([`test_names`]).
pub fn skipped_names(source: &str) -> Vec<String> {
    let Some(start) = source.find("skipped_without_feature!(") else {
        return Vec::new();
    };
    let list = &source[start..];
    let list = &list[list.find('(').unwrap_or(0) + 1..list.find(");").unwrap_or(list.len())];
    list.split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty() && !name.starts_with('"'))
        .map(str::to_string)
        .collect()
}

/// The `#[test]` functions of a test source file, in order: what a
/// `skipped_without_feature!` list must name.
pub fn test_names(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut after_attribute = false;
    for line in source.lines().map(str::trim) {
        if line == "#[test]" {
            after_attribute = true;
        } else if after_attribute && let Some(rest) = line.strip_prefix("fn ") {
            names.push(rest.split('(').next().unwrap_or_default().to_string());
            after_attribute = false;
        }
    }
    names
}

/// Says how a test checked what it checked (bitwise, or within a measured tolerance) on the
/// process's standard output, where the test harness does not capture it: the run's log then
/// shows which mode each claim was tested in.
pub fn note(line: impl Display) {
    let line = format!("{line}\n");
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(line.as_bytes());
    let _ = stdout.flush();
}
