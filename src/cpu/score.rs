//! How scores are formed from `Q·Kᵀ` and converted between units, for both CPU paths.

use crate::problem::Problem;

/// How scores are formed from `Q·Kᵀ` and converted (units: see `softmax`).
#[derive(Clone, Copy)]
pub(crate) struct ScoreMod {
    /// Scores in natural units (`scale · q·k`, then softcap, then ALiBi), because softcap or
    /// ALiBi is on; otherwise raw dot products.
    pub(crate) natural: bool,
    /// Score units to log2 units: `scale · log2 e` for raw dot products, `log2 e` for natural.
    pub(crate) c: f32,
    /// Score units to natural units (for the LSE): `scale`, or 1.
    pub(crate) u: f32,
    pub(crate) scale: f32,
    /// With softcap: the cap, the score being `cap · tanh(s / cap)`.
    pub(crate) softcap: Option<f32>,
}

impl ScoreMod {
    pub(crate) fn new(p: &Problem) -> Self {
        let units = p.score_units();
        ScoreMod { natural: units.natural, c: units.to_log2, u: units.to_natural, scale: p.scale, softcap: p.softcap }
    }

    /// A raw dot product in natural units: `scale · x`, then the softcap if any (ALiBi, which
    /// depends on the position, the caller adds). A division, as a straightforward
    /// implementation writes it: for a cap far above the scores, (s / cap) * cap gives s back
    /// to within an ulp, where s * (1 / cap) * cap accumulates three roundings.
    #[inline(always)]
    pub(crate) fn natural_score(&self, x: f32) -> f32 {
        let s = x * self.scale;
        match self.softcap {
            Some(cap) => cap * (s / cap).tanh(),
            None => s,
        }
    }
}
