//! Reading one launcher's variables, each failure an [`EnvError`] that names the launcher and
//! the variable.

use super::error::EnvError;
use super::launcher::EnvSource;

/// Answers `None` for an unset variable and `Err(lossy text)` for a value that is not UTF-8.
pub(crate) type Lookup<'a> = &'a dyn Fn(&str) -> Option<Result<String, String>>;

/// Whether `var` is set at all (to anything, even an empty or non-UTF-8 value).
pub(crate) fn is_set(lookup: Lookup<'_>, var: &str) -> bool {
    lookup(var).is_some()
}

/// `var` as a non-negative integer, `None` when unset or malformed (for detection, which
/// leaves the errors to the chosen launcher's reader).
pub(crate) fn parse_plain(lookup: Lookup<'_>, var: &str) -> Option<usize> {
    lookup(var)?.ok()?.trim().parse().ok()
}

/// A variable's name and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counted {
    /// Where the value comes from.
    pub var: &'static str,
    /// The value.
    pub value: usize,
}

/// One launcher's view of the environment.
#[derive(Clone, Copy)]
pub(crate) struct Vars<'a> {
    lookup: Lookup<'a>,
    launcher: EnvSource,
}

impl<'a> Vars<'a> {
    pub(crate) fn new(lookup: Lookup<'a>, launcher: EnvSource) -> Self {
        Vars { lookup, launcher }
    }

    /// The launcher being read.
    pub(crate) fn launcher(&self) -> EnvSource {
        self.launcher
    }

    /// The value of `var`, `None` when unset.
    pub(crate) fn text(&self, var: &'static str) -> Result<Option<String>, EnvError> {
        match (self.lookup)(var) {
            None => Ok(None),
            Some(Ok(text)) => Ok(Some(text)),
            Some(Err(lossy)) => Err(self.invalid(var, &lossy, "not valid UTF-8")),
        }
    }

    /// The first of `vars` that is set, with its name.
    pub(crate) fn first(
        &self,
        vars: &[&'static str],
    ) -> Result<Option<(&'static str, String)>, EnvError> {
        for &var in vars {
            if let Some(text) = self.text(var)? {
                return Ok(Some((var, text)));
            }
        }
        Ok(None)
    }

    /// The first of `vars` that is set, as an integer of at least `min`.
    pub(crate) fn count(
        &self,
        vars: &[&'static str],
        min: usize,
    ) -> Result<Option<Counted>, EnvError> {
        self.first(vars)?
            .map(|(var, text)| self.parse_count(var, &text, min))
            .transpose()
    }

    /// Like [`Vars::count`], for a variable the launcher always sets (the first one is named
    /// when none is set).
    pub(crate) fn required_count(
        &self,
        vars: &[&'static str],
        min: usize,
    ) -> Result<Counted, EnvError> {
        self.count(vars, min)?
            .ok_or_else(|| self.missing(vars.first().copied().unwrap_or("?")))
    }

    /// `text` (the value of `var`) as a non-negative integer of at least `min`.
    pub(crate) fn parse_count(
        &self,
        var: &'static str,
        text: &str,
        min: usize,
    ) -> Result<Counted, EnvError> {
        match text.trim().parse::<usize>() {
            Ok(value) if value >= min => Ok(Counted { var, value }),
            Ok(_) => Err(self.invalid(var, text, &format!("must be at least {min}"))),
            Err(_) => Err(self.invalid(var, text, "expected a non-negative integer")),
        }
    }

    /// An error: `var` is not set.
    pub(crate) fn missing(&self, var: &'static str) -> EnvError {
        EnvError::Missing {
            launcher: self.launcher,
            var,
        }
    }

    /// An error: `var=value` is invalid for `reason`.
    pub(crate) fn invalid(&self, var: &'static str, value: &str, reason: &str) -> EnvError {
        EnvError::Invalid {
            launcher: self.launcher,
            var,
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }

    /// An error: variables contradict each other.
    pub(crate) fn inconsistent(&self, reason: String) -> EnvError {
        EnvError::Inconsistent {
            launcher: self.launcher,
            reason,
        }
    }

    /// Checks that `index` is below `size`, whose origin `size_of` names.
    pub(crate) fn check_below(
        &self,
        index: Counted,
        size: usize,
        size_of: &'static str,
    ) -> Result<(), EnvError> {
        if index.value < size {
            return Ok(());
        }
        Err(EnvError::OutOfRange {
            launcher: self.launcher,
            var: index.var,
            value: index.value,
            size,
            size_of,
        })
    }
}
