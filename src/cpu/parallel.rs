//! The one place the CPU serving paths (varlen, paged, decode, split-KV combine) hand work to
//! threads.
//!
//! Today every call spawns scoped `std` threads; a persistent pool replaces the body of
//! [`for_each`] alone, with the same contract, and every caller follows.

use std::sync::Mutex;

/// Runs `work(&mut scratch, item)` once for every element of `items`, on up to `threads`
/// workers (the calling thread is one of them), and returns when all are done.
///
/// - Items are handed out one at a time in slice order (dynamic scheduling): put the heaviest
///   first so the tail is short.
/// - Each worker builds its own scratch with `scratch()` once and reuses it for all its items.
/// - Each item is a `&mut T`: an item owns its output slices, so workers never share memory
///   they write.
pub(crate) fn for_each<T: Send, S>(
    items: &mut [T],
    threads: usize,
    scratch: impl Fn() -> S + Sync,
    work: impl Fn(&mut S, &mut T) + Sync,
) {
    let n = threads.clamp(1, items.len().max(1));
    if n == 1 {
        let mut s = scratch();
        items.iter_mut().for_each(|it| work(&mut s, it));
        return;
    }
    let queue = Mutex::new(items.iter_mut());
    let worker = || {
        let mut s = scratch();
        loop {
            // A poisoned lock means another worker panicked; the scope re-raises that panic, so
            // this worker just keeps draining the queue.
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some(item) = next else { break };
            work(&mut s, item);
        }
    };
    std::thread::scope(|sc| {
        for _ in 1..n {
            sc.spawn(worker);
        }
        worker();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_once_with_per_worker_scratch() {
        for threads in [1, 2, 5] {
            let mut items: Vec<(usize, usize)> = (0..37).map(|i| (i, 0)).collect();
            for_each(
                &mut items,
                threads,
                || 0usize,
                |seen, it| {
                    *seen += 1;
                    it.1 = it.0 * 2 + 1;
                },
            );
            assert!(items.iter().all(|&(i, o)| o == i * 2 + 1));
        }
        let mut empty: Vec<u8> = Vec::new();
        for_each(&mut empty, 4, || (), |_, _| unreachable!());
    }
}
