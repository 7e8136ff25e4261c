//! Reuse of the large f32 scratch buffers (packed K/V) across calls.
//!
//! A fresh multi-megabyte `Vec` is a fresh `mmap`: every page faults in, zeroed by the kernel,
//! on first touch, a visible share of a long call's time. Buffers
//! handed back are kept (up to [`RETAIN_BYTES`] in all) for the next call; larger ones are freed.

use crate::error::Result;
use crate::tensor::try_filled;
use std::sync::Mutex;

/// Upper bound on the memory kept between calls.
const RETAIN_BYTES: usize = 96 << 20;

static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

fn pool() -> std::sync::MutexGuard<'static, Vec<Vec<f32>>> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The smallest kept buffer whose capacity holds `len` f32, taken out of the pool.
fn reuse(len: usize) -> Option<Vec<f32>> {
    let mut p = pool();
    let best = p.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity());
    best.map(|(i, _)| i).map(|i| p.swap_remove(i))
}

/// A buffer of `len` zeros, reusing a kept one when one is large enough; a new one is allocated
/// fallibly ([`crate::Error::TooLarge`] naming `what`).
pub(crate) fn take(len: usize, what: &str) -> Result<Vec<f32>> {
    let reused = reuse(len);
    match reused {
        Some(mut v) => {
            v.clear();
            v.resize(len, 0.0);
            Ok(v)
        }
        None => try_filled(len, 0.0, || format!("{what}: {len} f32")),
    }
}

/// As [`take`], but a reused buffer keeps its old contents (any f32, NaN and infinities
/// included): for callers that write every element before reading it, which saves zeroing
/// megabytes per call.
pub(crate) fn take_dirty(len: usize, what: &str) -> Result<Vec<f32>> {
    let reused = reuse(len);
    match reused {
        Some(mut v) => {
            // Only the part past the old length is filled (the capacity suffices: no allocation).
            v.resize(len, 0.0);
            Ok(v)
        }
        None => try_filled(len, 0.0, || format!("{what}: {len} f32")),
    }
}

/// Hands a buffer back for later calls (dropped if keeping it would exceed the bound, or if it
/// holds no memory: an empty one, e.g. the packed K of a head whose K is read in place, would
/// only lengthen every later search).
pub(crate) fn give(v: Vec<f32>) {
    if v.capacity() == 0 {
        return;
    }
    let mut p = pool();
    let kept: usize = p.iter().map(|b| b.capacity() * 4).sum();
    if kept + v.capacity() * 4 <= RETAIN_BYTES {
        p.push(v);
    }
}
