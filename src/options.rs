//! Options of a forward pass: `ForwardOptions::default().mask(Mask::Causal).softcap(30.0)`.

use std::sync::Arc;

/// Which keys a query row may attend to.
///
/// Causal and window masks follow FlashAttention 2.1+: they are aligned to the bottom-right
/// corner of the score matrix, so query row `i` sits at key position `i + seqlen_k - seqlen_q`.
/// A row whose window holds no key gives output 0 and LSE −inf.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mask {
    /// Every query sees every key.
    #[default]
    None,
    /// Query `i` sees keys `j <= i + seqlen_k - seqlen_q`.
    Causal,
    /// Query `i` sees keys `j` with `i + off - left <= j <= i + off + right`, `off = seqlen_k -
    /// seqlen_q`. A bound of `-1` is unbounded (FlashAttention's convention); any bound up to
    /// `i64::MAX` is accepted (one past the sequence sees what an unbounded side sees). With
    /// `causal: true` the right bound is 0: `right` must then be 0 or -1.
    Window { left: i64, right: i64, causal: bool },
}

impl Mask {
    /// A sliding window, `-1` for an unbounded side.
    pub fn window(left: i64, right: i64) -> Self {
        Mask::Window { left, right, causal: false }
    }
    /// A causal mask limited to `left` keys back (local causal attention, as Mistral).
    pub fn causal_window(left: i64) -> Self {
        Mask::Window { left, right: 0, causal: true }
    }
}

/// Where the computation runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// The GPU when one is present and the kernels were built, otherwise the CPU.
    #[default]
    Auto,
    /// The multi-threaded CPU backend.
    Cpu,
    /// CUDA device with this ordinal.
    Cuda(usize),
}

/// Which kernel family runs on the GPU. The CPU backend ignores it, except that it rejects a
/// GPU-only family explicitly requested.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Variant {
    /// The fastest family the GPU supports.
    #[default]
    Auto,
    /// FlashAttention-1 style: tiled online softmax on CUDA cores, any SM >= 8.0.
    Fa1,
    /// FlashAttention-2 style: `mma.sync` tensor cores, sm_80 and newer.
    Fa2,
    /// FlashAttention-3 style: TMA + wgmma, sm_90a.
    Fa3,
    /// FlashAttention-4 style: software exp2 and conditional rescaling.
    Fa4,
}

/// How Q, K and V are scaled before the FP8 cast.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fp8Scaling {
    /// One scale per (batch, head) for the whole sequence: the baseline.
    PerTensor,
    /// One scale per (batch, head, block of `rows` sequence positions), FA3's paper.
    PerBlock { rows: usize },
}

/// The arithmetic of the two products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Precision {
    /// Inputs as given, f32 accumulation and softmax.
    #[default]
    Native,
    /// Q, K, V and P in e4m3 with the given scaling, optionally with the random Hadamard rotation
    /// of Q and K (incoherent processing, seeded), f32 accumulation.
    Fp8 { scaling: Fp8Scaling, hadamard: Option<u64> },
}

/// How `exp2` is evaluated in the softmax.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Exp2 {
    /// An accurate exp2 (hardware MUFU on the GPU, a degree-5 polynomial on the CPU).
    #[default]
    Accurate,
    /// FA4's software exp2: a minimax polynomial of this degree (2..=5) on the fraction.
    Poly(u8),
}

/// When the running output and sum are rescaled.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub enum Rescale {
    /// Whenever the row max grows (FlashAttention 1-3).
    #[default]
    Always,
    /// Only when the row max grows by more than `threshold` in log2 units (FA4 uses 8).
    Lazy { threshold: f32 },
}

/// Options of [`crate::forward`]. Build with `Default` and chained setters.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ForwardOptions {
    /// Multiplies q·k; `None` means `1/sqrt(head_dim)`. Must lie in
    /// `[MIN_SOFTMAX_SCALE, f32::MAX / log2(e)]` (2^-120 up to where `scale · log2 e` overflows).
    pub softmax_scale: Option<f32>,
    pub mask: Mask,
    /// `scores -> cap * tanh(scores / cap)` (Gemma 2), applied after the softmax scale. Any normal
    /// f32 > 0 (up to `f32::MAX`).
    pub softcap: Option<f32>,
    /// One slope per query head; adds `-slope * |i + seqlen_k - seqlen_q - j|` to the scores.
    /// Each `|slope| · (max(seqlen_q, seqlen_k) - 1)` must be a finite f32.
    pub alibi_slopes: Option<Arc<[f32]>>,
    /// Attention sinks (gpt-oss, FlashAttention 4's `learnable_sink`): one logit per query head,
    /// in natural units, added to every row's softmax denominator as `exp(sink − max)` with no
    /// value, so `p_j = exp(s_j) / (Σ_i exp(s_i) + exp(sink))`; the LSE includes it, and a row
    /// that sees no key gets output 0 and LSE `sink`. `−inf` is no sink; NaN, `+inf` or another
    /// length than `heads_q` is [`crate::Error::InvalidOption`]. The CPU runs it, and so do the
    /// FA1, FA2 and FA3 kernels (dense and serving); FA4's rows refuse it (an explicit
    /// `Variant::Fa4` is an error).
    pub sinks: Option<Arc<[f32]>>,
    /// Return the softmax log-sum-exp (natural log), `[batch, heads_q, seqlen_q]`.
    pub return_lse: bool,
    pub backend: Backend,
    pub variant: Variant,
    pub precision: Precision,
    pub exp2: Exp2,
    pub rescale: Rescale,
    /// CPU worker threads, capped at `std::thread::available_parallelism` (which `None` and 0
    /// use).
    pub cpu_threads: Option<usize>,
    /// The rung of the FA3 stage ladder to run (1..=5, docs/fa3.md), with `Variant::Fa3` only;
    /// `None` runs the highest GPU-verified stage, or the highest compiled one if none is.
    pub fa3_stage: Option<u8>,
    /// The rung of the FA4 (Blackwell tcgen05) ladder to run (docs/fa4.md), with `Variant::Fa4`
    /// only. Those kernels have never run on a GPU: without this option `Variant::Fa4` never
    /// runs one (and `Auto` never does).
    pub fa4_stage: Option<u8>,
    /// FA4's softmax in the FA2 / FA3 pipelines (docs/fa4.md, "Part 1"), with `Variant::Fa4`
    /// only: one score element in `n` takes the software exp2 (0: none), which picks the kernel
    /// row with that share (the benchmark's sweep: 0, 8, 4); `None` takes the default row's
    /// (1 in 8). With `rescale(Rescale::Lazy { threshold })` it names one row of the sweep.
    pub fa4_exp2_share: Option<u32>,
    /// Key splits per work item on the split-KV (flash-decoding) paths: `None` uses the
    /// heuristic (docs/serving.md), `Some(n)` forces `n` (1..=128; 1 never splits). A
    /// performance choice only: every count gives the same attention up to rounding. Paths that
    /// do not split (the tiled prefill path) ignore it.
    pub num_splits: Option<usize>,
    /// The backward pass ([`crate::backward`]) gives bit-identical gradients from run to run and
    /// for any thread count: no floating-point atomics in the dq sum, which is then reduced in a
    /// fixed order. The CPU backward is deterministic either way; a GPU backward may use atomics
    /// when this is false (the default), where that is faster, and its `Dispatch` says so.
    pub deterministic: bool,
}

impl ForwardOptions {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }
    pub fn mask(mut self, mask: Mask) -> Self {
        self.mask = mask;
        self
    }
    /// Shorthand for `mask(Mask::Causal)` (or `Mask::None` when false).
    pub fn causal(self, causal: bool) -> Self {
        self.mask(if causal { Mask::Causal } else { Mask::None })
    }
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }
    pub fn alibi_slopes(mut self, slopes: impl Into<Arc<[f32]>>) -> Self {
        self.alibi_slopes = Some(slopes.into());
        self
    }
    /// One sink logit per query head (see [`ForwardOptions::sinks`]).
    pub fn sinks(mut self, sinks: impl Into<Arc<[f32]>>) -> Self {
        self.sinks = Some(sinks.into());
        self
    }
    pub fn return_lse(mut self, yes: bool) -> Self {
        self.return_lse = yes;
        self
    }
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    pub fn variant(mut self, variant: Variant) -> Self {
        self.variant = variant;
        self
    }
    pub fn precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }
    pub fn exp2(mut self, exp2: Exp2) -> Self {
        self.exp2 = exp2;
        self
    }
    pub fn rescale(mut self, rescale: Rescale) -> Self {
        self.rescale = rescale;
        self
    }
    pub fn cpu_threads(mut self, n: usize) -> Self {
        self.cpu_threads = Some(n);
        self
    }
    /// Runs stage `stage` (1..=5) of the FA3 ladder; needs `variant(Variant::Fa3)`. Checked
    /// when the problem is validated ([`crate::Error::InvalidOption`]).
    pub fn fa3_stage(mut self, stage: u8) -> Self {
        self.fa3_stage = Some(stage);
        self
    }
    /// Runs stage `stage` of the FA4 tcgen05 ladder (sm_100a only, docs/fa4.md); needs
    /// `variant(Variant::Fa4)`. Checked when the problem is validated.
    pub fn fa4_stage(mut self, stage: u8) -> Self {
        self.fa4_stage = Some(stage);
        self
    }
    /// Runs the FA4-softmax kernel whose software exp2 takes one score element in `n` (0: none;
    /// see [`ForwardOptions::fa4_exp2_share`]); needs `variant(Variant::Fa4)`. Checked when the
    /// problem is validated; a share no kernel row has is refused when the kernel is chosen.
    pub fn fa4_exp2_share(mut self, n: u32) -> Self {
        self.fa4_exp2_share = Some(n);
        self
    }
    /// Forces `n` key splits on the split-KV paths (see [`ForwardOptions::num_splits`]).
    pub fn num_splits(mut self, n: usize) -> Self {
        self.num_splits = Some(n);
        self
    }
    /// Asks the backward pass for bit-identical gradients across runs and thread counts (see
    /// [`ForwardOptions::deterministic`]).
    pub fn deterministic(mut self, yes: bool) -> Self {
        self.deterministic = yes;
        self
    }
}
