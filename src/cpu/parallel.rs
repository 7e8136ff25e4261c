//! The one place the CPU backend hands work to threads: the tiled forward (packing, attention),
//! varlen, paged, decode and the split-KV combine all call [`for_each`].
//!
//! Workers come from a persistent pool, rayon's global pool (`rayon-core`), created on first
//! use and sized once (`RAYON_NUM_THREADS`, else the available parallelism), and shared with
//! whatever else in the process uses rayon (candle's CPU ops do): no thread is spawned per call.
//! The calling thread is always one of the workers and drains the queue itself, so a call
//! completes even when every pool thread is busy elsewhere (pool tasks that start after the
//! queue is empty return at once), and concurrent or nested calls cannot deadlock.

use std::sync::{Mutex, OnceLock};

/// Whether the pool is usable: rayon panics when it cannot start its threads; then every call
/// runs on the calling thread alone (the work is the same, only slower).
fn pool_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| std::panic::catch_unwind(rayon_core::current_num_threads).is_ok_and(|n| n > 0))
}

/// Runs `work(&mut scratch, item)` once for every element of `items`, on up to `threads`
/// workers (the calling thread is one of them), and returns when all are done.
///
/// - Items are handed out one at a time in slice order (dynamic scheduling): put the heaviest
///   first so the tail is short.
/// - Each worker builds its own scratch with `scratch()` once and reuses it for all its items.
/// - Each item is a `&mut T`: an item owns its output slices, so workers never share memory
///   they write.
/// - A panic in `work` (a bug: the public API validates everything first) reaches the caller
///   once every worker has stopped, as with scoped threads.
pub(crate) fn for_each<T: Send, S>(
    items: &mut [T],
    threads: usize,
    scratch: impl Fn() -> S + Sync,
    work: impl Fn(&mut S, &mut T) + Sync,
) {
    let n = threads.clamp(1, items.len().max(1));
    if n == 1 || !pool_usable() {
        let mut s = scratch();
        items.iter_mut().for_each(|it| work(&mut s, it));
        return;
    }
    let queue = Mutex::new(items.iter_mut());
    let worker = || {
        // Scratch only once there is an item: a pool task that starts late finds the queue empty
        // and returns without allocating.
        let mut s = None;
        loop {
            // A poisoned lock means another worker panicked; the scope re-raises that panic, so
            // this worker just keeps draining the queue.
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some(item) = next else { break };
            work(s.get_or_insert_with(&scratch), item);
        }
    };
    rayon_core::in_place_scope(|sc| {
        for _ in 1..n {
            sc.spawn(|_| worker());
        }
        worker();
    });
}

/// Number of worker threads: the request, capped at the machine's available parallelism (more
/// threads than cores only add scheduling and memory on this compute-bound work); `None` or 0
/// uses the available parallelism. That is read once per process, because
/// `available_parallelism` reads the cgroup's CPU quota from /sys on every call, which costs
/// more than a small decode call itself, and the worker pool's size is fixed when it starts
/// anyway.
pub(crate) fn threads(requested: Option<usize>) -> usize {
    static HW: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let hw = *HW.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    requested.filter(|&n| n > 0).map_or(hw, |n| n.min(hw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

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

    #[test]
    fn concurrent_and_nested_callers() {
        // Eight application threads at once, each call nesting another: every item of every
        // call exactly once, no deadlock even though the callers outnumber the pool.
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..8usize {
                let total = &total;
                s.spawn(move || {
                    for round in 0..20 {
                        let mut items: Vec<usize> = (0..16).map(|i| i + t + round).collect();
                        for_each(
                            &mut items,
                            4,
                            || (),
                            |_, x| {
                                let mut inner = [*x, *x + 1, *x + 2];
                                for_each(&mut inner, 2, || (), |_, y| *y *= 2);
                                *x = inner.iter().sum();
                                total.fetch_add(1, Ordering::Relaxed);
                            },
                        );
                        for (i, &x) in items.iter().enumerate() {
                            assert_eq!(x, 2 * (3 * (i + t + round) + 3));
                        }
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 8 * 20 * 16);
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
        let r = std::panic::catch_unwind(|| {
            let mut items: Vec<usize> = (0..64).collect();
            for_each(&mut items, 4, || (), |_, x| assert!(*x != 40, "item 40"));
        });
        assert!(r.is_err());
        let mut items: Vec<usize> = (0..64).collect();
        for_each(&mut items, 4, || (), |_, x| *x += 1);
        assert!(items.iter().enumerate().all(|(i, &x)| x == i + 1));
    }

    #[test]
    fn thread_requests_are_capped_at_the_available_parallelism() {
        let hw = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(threads(None), hw);
        assert_eq!(threads(Some(0)), hw);
        assert_eq!(threads(Some(1)), 1);
        assert_eq!(threads(Some(1_000_000)), hw);
        assert_eq!(threads(Some(usize::MAX)), hw);
    }
}
