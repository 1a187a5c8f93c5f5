//! Locks that outlive a panic.
//!
//! burn-zero catches a failing rank's panic (the launcher turns it into an error and aborts the
//! group) and goes on using the locks that rank may have held: the other ranks must still
//! report, clean up and stop. Every value behind these locks is kept consistent between
//! statements, so a lock poisoned by a panic elsewhere is taken as it is rather than turning
//! one rank's failure into a second panic on every thread that touches the lock afterwards.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `mutex`, whether or not a thread panicked while holding it.
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Takes `mutex`'s value, whether or not a thread panicked while holding it.
pub fn into_inner<T>(mutex: Mutex<T>) -> T {
    mutex
        .into_inner()
        .unwrap_or_else(|poison| poison.into_inner())
}

/// Read-locks `lock`, whether or not a thread panicked while holding it.
pub fn read<T: ?Sized>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poison| poison.into_inner())
}

/// Write-locks `lock`, whether or not a thread panicked while holding it.
pub fn write<T: ?Sized>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|poison| poison.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_still_gives_its_value() {
        let mutex = std::sync::Arc::new(Mutex::new(1));
        let poisoner = mutex.clone();
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(mutex.is_poisoned());
        *lock(&mutex) += 1;
        assert_eq!(*lock(&mutex), 2);
        let rw = RwLock::new(3);
        *write(&rw) += 1;
        assert_eq!(*read(&rw), 4);
        let mutex = std::sync::Arc::into_inner(mutex).unwrap();
        assert_eq!(into_inner(mutex), 2);
    }
}
