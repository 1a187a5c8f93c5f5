//! Which wgpu adapter a bench would run on, asked without panicking: the `chunks` and
//! `optimizer` benches report it beside their wgpu rows, or why those rows are missing.

use burn::backend::wgpu::graphics::AutoGraphicsApi;
use burn::backend::wgpu::{RuntimeOptions, WgpuDevice, init_setup};

/// The name of the wgpu adapter Burn's default device gets, or why there is none. Burn panics
/// on first use of a device without an adapter; the probe initialises the default device
/// itself (with the options Burn's lazy initialisation uses) and catches that panic.
pub fn wgpu_adapter() -> Result<String, String> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let probe = std::panic::catch_unwind(|| {
        let setup =
            init_setup::<AutoGraphicsApi>(&WgpuDevice::default(), RuntimeOptions::default());
        let info = setup.adapter.get_info();
        format!("{} ({:?}, {})", info.name, info.backend, info.driver_info)
    });
    std::panic::set_hook(hook);
    probe.map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the wgpu device panicked".into())
    })
}
