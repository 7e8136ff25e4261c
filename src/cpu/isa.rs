//! The instruction set the CPU paths run on: the best this CPU has, detected at run time.

/// The instruction sets the tiled path is compiled for, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F (+ AVX2, FMA): the same loops in 512-bit registers (a 16-query panel row is one).
    Avx512,
    Avx2Fma,
    Portable,
}

/// The best [`Isa`] this CPU has (detected at run time), unless `FLASH_ATTN_CPU_ISA` asks for a
/// lesser one (`avx2`, `portable`: to compare paths on one machine; never a better one than the
/// CPU has).
pub(crate) fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let detected = detect_isa();
        let cap = match std::env::var("FLASH_ATTN_CPU_ISA").as_deref() {
            Ok("portable") => Isa::Portable,
            Ok("avx2") => Isa::Avx2Fma,
            _ => Isa::Avx512,
        };
        // Variants are ordered best first: the larger of the two is the lesser ISA.
        if (cap as u8) > (detected as u8) {
            cap
        } else {
            detected
        }
    })
}

pub(crate) fn detect_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
        if avx2 && std::is_x86_feature_detected!("avx512f") {
            return Isa::Avx512;
        }
        if avx2 {
            return Isa::Avx2Fma;
        }
    }
    Isa::Portable
}
