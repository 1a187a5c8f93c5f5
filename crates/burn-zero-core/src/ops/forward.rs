//! Macros that write the forwarding bodies of `Zero<B>`'s ops.
//!
//! A signature lists each argument with a kind: `F` (a float tensor of `Zero<B>`, materialised
//! before the call), `VF` (a `Vec` of them), `OF` (an `Option` of one), or `[T]` (any other
//! type, passed through). Return kinds: `F` (wrapped as a local tensor), `FI`/`FF` (tuples with
//! a float first), or `[T]` (passed through).

/// The Rust type of an argument or return kind.
macro_rules! zero_ty {
    (F) => { $crate::tensor::ZeroTensor<B> };
    (VF) => { Vec<$crate::tensor::ZeroTensor<B>> };
    (OF) => { Option<$crate::tensor::ZeroTensor<B>> };
    (FI) => { ($crate::tensor::ZeroTensor<B>, burn::tensor::ops::IntTensor<B>) };
    (FF) => { ($crate::tensor::ZeroTensor<B>, $crate::tensor::ZeroTensor<B>) };
    ([$t:ty]) => { $t };
}

/// Converts an argument of `Zero<B>` into the inner backend's.
macro_rules! zero_arg {
    (F, $a:ident) => {
        $a.materialize()
    };
    (VF, $a:ident) => {
        $a.into_iter()
            .map($crate::tensor::ZeroTensor::materialize)
            .collect()
    };
    (OF, $a:ident) => {
        $a.map($crate::tensor::ZeroTensor::materialize)
    };
    ([$t:ty], $a:ident) => {
        $a
    };
}

/// Converts the inner backend's result into `Zero<B>`'s.
macro_rules! zero_ret {
    (F, $e:expr) => {
        $crate::tensor::ZeroTensor::Local($e)
    };
    (FI, $e:expr) => {{
        let (f, i) = $e;
        ($crate::tensor::ZeroTensor::Local(f), i)
    }};
    (FF, $e:expr) => {{
        let (a, b) = $e;
        (
            $crate::tensor::ZeroTensor::Local(a),
            $crate::tensor::ZeroTensor::Local(b),
        )
    }};
    ([$t:ty], $e:expr) => {
        $e
    };
}

/// Writes `fn name(args) -> ret { convert(B::name(convert(args))) }` for every signature.
macro_rules! forward_ops {
    ($( fn $name:ident ( $( $arg:ident : $k:tt ),* $(,)? ) -> $r:tt ; )*) => {
        $(
            fn $name( $( $arg : zero_ty!($k) ),* ) -> zero_ty!($r) {
                zero_ret!($r, B::$name( $( zero_arg!($k, $arg) ),* ))
            }
        )*
    };
}

pub(crate) use {forward_ops, zero_arg, zero_ret, zero_ty};
