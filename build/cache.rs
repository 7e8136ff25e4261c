//! The kernel cache: compiled images keyed by content (the unit, every file it includes, the
//! nvcc flags, the toolchain fingerprint; paths relative to the crate root), in a directory
//! every profile and tool shares.

use crate::toolchain::Toolchain;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The cache key of one nvcc job: the cache format, the toolchain, nvcc's own flag variables,
/// the job's arguments and unit text, and every file the unit includes with its content.
/// `portable` writes the paths relative to the crate root and OUT_DIR (which differ per
/// checkout and profile), so one cache serves every checkout of the same sources.
pub(crate) fn key(
    tc: &Toolchain,
    args: &str,
    text: &str,
    deps: &BTreeMap<String, Vec<u8>>,
    portable: &dyn Fn(&str) -> String,
) -> u128 {
    let env_flags: String = ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"]
        .iter()
        .map(|v| format!("{v}={}\n", std::env::var(v).unwrap_or_default()))
        .collect();
    let mut key = Fnv128::new();
    key.add(CACHE_FORMAT.as_bytes());
    key.add(tc.fingerprint.as_bytes());
    key.add(env_flags.as_bytes());
    key.add(portable(args).as_bytes());
    key.add(portable(text).as_bytes());
    // In the order of the portable paths, which does not depend on where root is.
    let mut files: Vec<(String, &Vec<u8>)> = deps.iter().map(|(p, c)| (portable(p), c)).collect();
    files.sort();
    for (path, content) in files {
        key.add(path.as_bytes());
        key.add(content);
    }
    key.finish()
}

/// Bumped when anything the cache key does not cover changes (the post-processing of images).
const CACHE_FORMAT: &str = "flash_attn kernel cache 1";

/// Where compiled images are kept across profiles and tools: `$FLASH_ATTN_KERNEL_CACHE`, else
/// `flash-attn-kernels/` in cargo's target directory (found from OUT_DIR,
/// `<target>/[<triple>/]<profile>/build/<pkg>-<hash>/out`), so `cargo clean` clears it and a
/// dependent crate's build (whose own directory is read-only in the registry) writes only into
/// its own target directory.
pub(crate) fn cache_dir(out: &Path) -> PathBuf {
    if let Some(d) = std::env::var_os("FLASH_ATTN_KERNEL_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let build = out.ancestors().nth(2);
    match (build, out.ancestors().nth(4)) {
        (Some(b), Some(target)) if b.file_name().is_some_and(|n| n == "build") => target.join("flash-attn-kernels"),
        _ => out.join("kernel-cache"),
    }
}

/// `file` and every file it `#include "..."`s, recursively (resolved next to the including
/// file, then in each of `include_dirs`), with their contents. Conditional includes count too: a
/// superset only costs a rebuild more.
pub(crate) fn collect_includes(file: &Path, include_dirs: &[PathBuf], seen: &mut BTreeMap<String, Vec<u8>>) {
    let key = file.display().to_string();
    if seen.contains_key(&key) {
        return;
    }
    let Ok(bytes) = std::fs::read(file) else { return };
    let text = String::from_utf8_lossy(&bytes).into_owned();
    seen.insert(key, bytes);
    for line in text.lines() {
        let l = line.trim_start();
        let Some(rest) = l.strip_prefix('#') else { continue };
        let Some(rest) = rest.trim_start().strip_prefix("include") else { continue };
        let Some(name) = rest.trim().strip_prefix('"').and_then(|r| r.split('"').next()) else { continue };
        let here = file.parent().unwrap_or(Path::new(".")).join(name);
        let found = std::iter::once(here).chain(include_dirs.iter().map(|d| d.join(name))).find(|f| f.is_file());
        if let Some(found) = found {
            collect_includes(&found, include_dirs, seen);
        }
    }
}

pub(crate) fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap();
    }
}

/// A hard link of the cache entry into OUT_DIR (a copy across file systems).
pub(crate) fn link_or_copy(from: &Path, to: &Path) {
    let _ = std::fs::remove_file(to);
    if std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", from.display(), to.display()));
    }
}

/// FNV-1a, 128 bits: a stable content hash with no dependency (collisions among a cache's few
/// hundred entries are out of reach; nothing adversarial writes into the cache).
struct Fnv128(u128);

impl Fnv128 {
    fn new() -> Self {
        Fnv128(0x6c62272e07bb014262b821756295c58d)
    }
    /// Adds one field; its length is added first, so fields cannot run into each other.
    fn add(&mut self, bytes: &[u8]) {
        for b in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 ^= *b as u128;
            self.0 = self.0.wrapping_mul(0x0000000001000000000000000000013B);
        }
    }
    fn finish(&self) -> u128 {
        self.0
    }
}
