//! The host rules of each pipeline: the one map from a table row's [`Pipeline`] to the
//! [`FamilyHost`] of its module. The table stays plain data that names no module, and the
//! family modules depend on the table, never the other way.

use super::family::FamilyHost;
use super::fa1::Fa1;
use super::fa2::Fa2;
use super::fa3::Fa3;
use super::fa4::Fa4;
use super::fp8::Fp8;
use super::table::{Family, Pipeline};

/// The host rules of `fam`'s launches: refusals, layout rules, grid, tensor maps.
pub(crate) fn family_host(fam: &Family) -> &'static dyn FamilyHost {
    match fam.pipeline {
        Pipeline::Fa1 => &Fa1,
        Pipeline::Fa2 => &Fa2,
        Pipeline::Fa3 => &Fa3,
        Pipeline::Fa3Fp8 => &Fp8,
        Pipeline::Fa4 => &Fa4,
    }
}
