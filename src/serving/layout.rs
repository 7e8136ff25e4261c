//! The batch layout of a serving call: where each sequence's query rows and keys lie. Defined in
//! `crate::batch_layout`, below the backends that read it (this module sits above them).

pub use crate::batch_layout::{BatchLayout, CacheRows, KvLayout, QueryLayout};
