//! The CUDA libraries loaded at run time, the names they are looked up under, and an error
//! that names the missing one and how to provide it.
//!
//! Nothing CUDA is linked at build time: `cudarc` opens the driver (`libcuda`), the runtime
//! compiler (`libnvrtc`, which cubecl-cuda uses for every kernel) and NCCL (`libnccl`) with
//! `dlopen` on first use, trying a fixed list of file names, and panics when none loads. The
//! names depend on the CUDA version the build was made for. This workspace fixes it at 13.0,
//! whose list tries `.so`, then `.so.13`, then `.so.12` and older: one binary, made on a machine
//! without nvcc, loads on CUDA 12 and CUDA 13 machines. `check` tries the same names before
//! the first CUDA call, so a missing library is a [`MissingLibrary`] error instead of a panic.

use std::fmt;

/// A shared library the CUDA engine loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// The NVIDIA driver's CUDA library (`libcuda.so.1`).
    Driver,
    /// The CUDA runtime compiler, which compiles CubeCL's kernels (`libnvrtc.so.12`/`.13`).
    Nvrtc,
    /// NCCL, for the collectives (`libnccl.so`).
    Nccl,
}

impl CudaLibrary {
    /// Every library, in the order they are first needed.
    pub const ALL: [CudaLibrary; 3] = [CudaLibrary::Driver, CudaLibrary::Nvrtc, CudaLibrary::Nccl];

    /// The library names `cudarc` derives its file names from.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn stems(self) -> &'static [&'static str] {
        match self {
            CudaLibrary::Driver => &["cuda", "nvcuda"],
            CudaLibrary::Nvrtc => &["nvrtc"],
            CudaLibrary::Nccl => &["nccl"],
        }
    }

    /// Names the library is commonly installed under that `cudarc` does not try: finding one
    /// of them loadable turns the advice into the one step that is missing.
    fn unsearched_names(self) -> &'static [&'static str] {
        match self {
            // NCCL's soname; the pip packages ship only this file.
            CudaLibrary::Nccl => &["libnccl.so.2"],
            CudaLibrary::Driver | CudaLibrary::Nvrtc => &[],
        }
    }

    /// How to make the library loadable.
    fn advice(self) -> &'static str {
        match self {
            CudaLibrary::Driver => {
                "it comes with the NVIDIA driver: check that `nvidia-smi` works here; in a \
                 container, start it with the GPUs exposed (e.g. `docker run --gpus all`)"
            }
            CudaLibrary::Nvrtc => {
                "it comes with the CUDA toolkit, 12.x or 13.x (e.g. /usr/local/cuda/lib64), or the \
                 pip package nvidia-cuda-nvrtc-cu12 (CUDA 12) / nvidia-cuda-nvrtc (CUDA 13): add the \
                 folder that holds it to LD_LIBRARY_PATH"
            }
            CudaLibrary::Nccl => {
                "add the folder that holds libnccl.so to LD_LIBRARY_PATH; the pip packages \
                 nvidia-nccl-cu12 and nvidia-nccl-cu13 ship only libnccl.so.2 (in nvidia/nccl/lib): \
                 create a symlink named libnccl.so to it in that folder"
            }
        }
    }
}

impl fmt::Display for CudaLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CudaLibrary::Driver => "libcuda (the NVIDIA driver)",
            CudaLibrary::Nvrtc => "libnvrtc (the CUDA runtime compiler)",
            CudaLibrary::Nccl => "libnccl (NCCL)",
        })
    }
}

/// A CUDA library that none of its names loads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{library} cannot be loaded (tried {}): {advice}", .tried.join(", "))]
pub struct MissingLibrary {
    /// The library.
    pub library: CudaLibrary,
    /// The file names tried, in order.
    pub tried: Vec<String>,
    /// What makes it loadable.
    pub advice: String,
}

/// Whether one of `candidates` loads (per `loads`); otherwise the error, with advice that
/// accounts for the library being installed under a name the loader does not try.
pub fn diagnose(
    library: CudaLibrary,
    candidates: &[String],
    loads: impl Fn(&str) -> bool,
) -> Result<(), MissingLibrary> {
    if candidates.iter().any(|name| loads(name)) {
        return Ok(());
    }
    let advice = match library.unsearched_names().iter().find(|name| loads(name)) {
        Some(found) => format!(
            "{found} loads, but it is not one of the names tried: create a symlink named {} to \
             it in a folder on LD_LIBRARY_PATH",
            candidates.first().map_or("lib<name>.so", String::as_str)
        ),
        None => library.advice().to_string(),
    };
    Err(MissingLibrary {
        library,
        tried: candidates.to_vec(),
        advice,
    })
}

/// The file names `cudarc` tries for `library` in this build, in order.
#[cfg(feature = "cuda")]
pub fn candidates(library: CudaLibrary) -> Vec<String> {
    library
        .stems()
        .iter()
        .flat_map(|stem| cudarc::get_lib_name_candidates(stem))
        .collect()
}

/// Checks that each of `libraries` loads under a name `cudarc` tries, before `cudarc` would
/// panic on it.
#[cfg(feature = "cuda")]
pub fn check(libraries: &[CudaLibrary]) -> Result<(), MissingLibrary> {
    for &library in libraries {
        diagnose(library, &candidates(library), loads)?;
    }
    Ok(())
}

/// Whether the dynamic loader can open `name`.
#[cfg(feature = "cuda")]
fn loads(name: &str) -> bool {
    // SAFETY: opening a CUDA library runs its initialisers, which have no preconditions; the
    // handle is closed at once and no symbol of it is used (cudarc probes the same way).
    unsafe { libloading::Library::new(name) }.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|name| name.to_string()).collect()
    }

    #[test]
    fn a_loadable_candidate_is_enough() {
        let candidates = names(&["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]);
        let found = diagnose(CudaLibrary::Nvrtc, &candidates, |name| {
            name == "libnvrtc.so.12"
        });
        assert_eq!(found, Ok(()));
    }

    #[test]
    fn a_missing_library_is_named_with_what_was_tried_and_the_fix() {
        let candidates = names(&["libnvrtc.so", "libnvrtc.so.13"]);
        let error = diagnose(CudaLibrary::Nvrtc, &candidates, |_| false).unwrap_err();
        assert_eq!(error.library, CudaLibrary::Nvrtc);
        assert_eq!(error.tried, candidates);
        let text = error.to_string();
        for part in [
            "libnvrtc (the CUDA runtime compiler) cannot be loaded",
            "libnvrtc.so, libnvrtc.so.13",
            "LD_LIBRARY_PATH",
            "nvidia-cuda-nvrtc",
        ] {
            assert!(text.contains(part), "{part:?} not in {text:?}");
        }
    }

    #[test]
    fn nccl_installed_under_its_soname_only_gets_the_symlink_advice() {
        let candidates = names(&["libnccl.so", "libnccl.so.13", "libnccl.so.12"]);
        let error = diagnose(CudaLibrary::Nccl, &candidates, |name| {
            name == "libnccl.so.2"
        })
        .unwrap_err();
        assert!(
            error.advice.starts_with("libnccl.so.2 loads")
                && error.advice.contains("symlink named libnccl.so"),
            "{}",
            error.advice
        );
        let absent = diagnose(CudaLibrary::Nccl, &candidates, |_| false).unwrap_err();
        assert!(
            absent.advice.contains("nvidia-nccl-cu13"),
            "{}",
            absent.advice
        );
    }

    #[test]
    fn the_driver_advice_points_at_the_driver() {
        let error =
            diagnose(CudaLibrary::Driver, &names(&["libcuda.so.1"]), |_| false).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("libcuda") && text.contains("nvidia-smi"),
            "{text}"
        );
    }

    /// The build's CUDA version decides the names: CUDA 13's files must be tried, and CUDA
    /// 12's as well, for one binary to load on both.
    #[cfg(feature = "cuda")]
    #[test]
    fn this_build_tries_the_cuda_12_and_13_names() {
        let nvrtc = candidates(CudaLibrary::Nvrtc);
        for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
            assert!(nvrtc.iter().any(|n| n == name), "{name} not in {nvrtc:?}");
        }
        let position = |name: &str| nvrtc.iter().position(|n| n == name).unwrap();
        assert!(position("libnvrtc.so.13") < position("libnvrtc.so.12"));
        let driver = candidates(CudaLibrary::Driver);
        assert!(driver.iter().any(|n| n == "libcuda.so.1"), "{driver:?}");
        let nccl = candidates(CudaLibrary::Nccl);
        assert!(nccl.iter().any(|n| n == "libnccl.so"), "{nccl:?}");
    }

    /// Where a library is absent (no CUDA on this machine), `check` says so instead of
    /// `cudarc` panicking.
    #[cfg(feature = "cuda")]
    #[test]
    fn check_names_an_absent_library() {
        let absent: Vec<CudaLibrary> = CudaLibrary::ALL
            .into_iter()
            .filter(|&library| !candidates(library).iter().any(|name| loads(name)))
            .collect();
        if absent.is_empty() {
            burn_zero_testing::skip::skip(
                "check_names_an_absent_library",
                "every CUDA library is installed here",
            );
            return;
        }
        for library in absent {
            let error = check(&[library]).unwrap_err();
            assert_eq!(error.library, library);
            assert_eq!(error.tried, candidates(library));
            assert!(error.to_string().contains(&error.tried[0]), "{error}");
        }
    }
}
