//! Host tensors in FlashAttention's layout `[batch, seqlen, heads, head_dim]`.
//!
//! `head_dim` is always contiguous (stride 1); the other three strides are free, so a view can
//! point into a packed QKV buffer or a KV cache without a copy.

use crate::error::{Error, Operand, Result};
use half::{bf16, f16};

pub use crate::dtype::DType;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A scalar type q, k, v and o may hold: `f32`, `half::f16` or `half::bf16`.
pub trait Element: sealed::Sealed + Copy + Send + Sync + Default + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// Wrap a borrowed slice of this type.
    fn wrap(s: &[Self]) -> Data<'_>;
    /// Wrap an owned vector of this type.
    fn wrap_owned(v: Vec<Self>) -> OwnedData;
    /// Wrap a mutable slice of this type (an output buffer).
    fn wrap_mut(s: &mut [Self]) -> DataMut<'_>;
    /// The vector inside `d` when it holds this type, else `d` back.
    fn unwrap_owned(d: OwnedData) -> std::result::Result<Vec<Self>, OwnedData>;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn wrap(s: &[Self]) -> Data<'_> {
        Data::F32(s)
    }
    fn wrap_owned(v: Vec<Self>) -> OwnedData {
        OwnedData::F32(v)
    }
    fn wrap_mut(s: &mut [Self]) -> DataMut<'_> {
        DataMut::F32(s)
    }
    fn unwrap_owned(d: OwnedData) -> std::result::Result<Vec<Self>, OwnedData> {
        match d {
            OwnedData::F32(v) => Ok(v),
            other => Err(other),
        }
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn wrap(s: &[Self]) -> Data<'_> {
        Data::F16(s)
    }
    fn wrap_owned(v: Vec<Self>) -> OwnedData {
        OwnedData::F16(v)
    }
    fn wrap_mut(s: &mut [Self]) -> DataMut<'_> {
        DataMut::F16(s)
    }
    fn unwrap_owned(d: OwnedData) -> std::result::Result<Vec<Self>, OwnedData> {
        match d {
            OwnedData::F16(v) => Ok(v),
            other => Err(other),
        }
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn wrap(s: &[Self]) -> Data<'_> {
        Data::BF16(s)
    }
    fn wrap_owned(v: Vec<Self>) -> OwnedData {
        OwnedData::BF16(v)
    }
    fn wrap_mut(s: &mut [Self]) -> DataMut<'_> {
        DataMut::BF16(s)
    }
    fn unwrap_owned(d: OwnedData) -> std::result::Result<Vec<Self>, OwnedData> {
        match d {
            OwnedData::BF16(v) => Ok(v),
            other => Err(other),
        }
    }
}

/// A borrowed slice of one of the element types.
#[derive(Clone, Copy, Debug)]
pub enum Data<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl Data<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::BF16(_) => DType::BF16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Data::F32(s) => s.len(),
            Data::F16(s) => s.len(),
            Data::BF16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element `i` widened to f32.
    ///
    /// # Panics
    /// If `i` is out of bounds, as slice indexing does.
    #[inline]
    pub fn get_f32(&self, i: usize) -> f32 {
        match self {
            Data::F32(s) => s[i],
            Data::F16(s) => s[i].to_f32(),
            Data::BF16(s) => s[i].to_f32(),
        }
    }
    /// Widen `dst.len()` consecutive elements starting at `start` into `dst`.
    ///
    /// # Panics
    /// If `start + dst.len()` exceeds the length, as slice indexing does.
    #[inline]
    pub fn read_f32(&self, start: usize, dst: &mut [f32]) {
        let n = dst.len();
        match self {
            Data::F32(s) => dst.copy_from_slice(&s[start..start + n]),
            // A whole row at a time, in vector instructions where the CPU has them.
            Data::F16(s) => crate::convert::widen_f16(&s[start..start + n], dst),
            Data::BF16(s) => crate::convert::widen_bf16(&s[start..start + n], dst),
        }
    }
}

/// A mutable slice of one of the element types: a caller's output buffer.
#[derive(Debug)]
pub enum DataMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
}

impl DataMut<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            DataMut::F32(_) => DType::F32,
            DataMut::F16(_) => DType::F16,
            DataMut::BF16(_) => DType::BF16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            DataMut::F32(s) => s.len(),
            DataMut::F16(s) => s.len(),
            DataMut::BF16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An owned, contiguous buffer of one of the element types.
#[derive(Clone, Debug, PartialEq)]
pub enum OwnedData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl OwnedData {
    /// `n` zeros of `dtype`, allocated fallibly: [`Error::TooLarge`] when the allocation fails.
    pub fn zeros(dtype: DType, n: usize) -> Result<Self> {
        let what = || format!("{n} elements of {dtype:?}");
        Ok(match dtype {
            DType::F32 => OwnedData::F32(try_filled(n, 0.0, what)?),
            DType::F16 => OwnedData::F16(try_filled(n, f16::ZERO, what)?),
            DType::BF16 => OwnedData::BF16(try_filled(n, bf16::ZERO, what)?),
        })
    }
    pub fn as_data(&self) -> Data<'_> {
        match self {
            OwnedData::F32(v) => Data::F32(v),
            OwnedData::F16(v) => Data::F16(v),
            OwnedData::BF16(v) => Data::BF16(v),
        }
    }
    pub fn dtype(&self) -> DType {
        self.as_data().dtype()
    }
    /// The buffer as a mutable slice.
    pub fn as_data_mut(&mut self) -> DataMut<'_> {
        match self {
            OwnedData::F32(v) => DataMut::F32(v),
            OwnedData::F16(v) => DataMut::F16(v),
            OwnedData::BF16(v) => DataMut::BF16(v),
        }
    }
}

/// `[batch, seqlen, heads, head_dim]`.
pub type Shape = [usize; 4];

/// A borrowed host tensor `[batch, seqlen, heads, head_dim]` with element strides for the first
/// three dimensions; `head_dim` has stride 1.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    data: Data<'a>,
    shape: Shape,
    strides: [usize; 3],
}

/// Contiguous strides of a `[b, s, h, d]` tensor, or `None` on overflow.
pub(crate) fn contiguous_strides(shape: Shape) -> Option<[usize; 3]> {
    let [_, s, h, d] = shape;
    let hs = d;
    let ss = h.checked_mul(d)?;
    let bs = s.checked_mul(ss)?;
    Some([bs, ss, hs])
}

/// Number of elements of a `[b, s, h, d]` tensor, or an error on overflow.
pub(crate) fn numel(shape: Shape, what: &str) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &x| acc.checked_mul(x))
        .ok_or_else(|| Error::TooLarge { what: format!("{what} of shape {shape:?} (its element count overflows usize)") })
}

/// Checks that a tensor of `shape` and `elem_bytes`-byte elements can exist in memory: its
/// element count, its contiguous strides and its size in bytes fit (the bytes in `isize::MAX`,
/// Rust's limit for one allocation). Returns the element count.
pub(crate) fn check_size(shape: Shape, elem_bytes: usize, what: &str) -> Result<usize> {
    let n = numel(shape, what)?;
    let fits = contiguous_strides(shape).is_some() && n.checked_mul(elem_bytes).is_some_and(|b| b <= isize::MAX as usize);
    if !fits {
        return Err(Error::TooLarge {
            what: format!("{what} of shape {shape:?} ({n} elements of {elem_bytes} bytes, or its strides, exceed the address space)"),
        });
    }
    Ok(n)
}

/// An empty vector with room for `n` items, allocated fallibly ([`Error::TooLarge`] naming
/// `what()`), its pages advised for huge pages when large ([`advise_huge_pages`]) before anything
/// is written to them.
fn try_reserve<T>(n: usize, what: impl FnOnce() -> String) -> Result<Vec<T>> {
    let mut v = Vec::new();
    if v.try_reserve_exact(n).is_err() {
        return Err(Error::TooLarge {
            what: format!("{} ({} bytes): the allocation failed", what(), n as u128 * std::mem::size_of::<T>() as u128),
        });
    }
    advise_huge_pages(&v);
    Ok(v)
}

/// Buffers of at least this many bytes are advised for transparent huge pages: numpy's rule
/// (`madvise(MADV_HUGEPAGE)` on every array of 4 MiB or more, on by default on Linux), so a
/// tensor made here is backed as the peers' numpy inputs are.
pub(crate) const HUGE_PAGE_MIN_BYTES: usize = 1 << 22;

/// Asks Linux to back the pages of `v`'s allocation with transparent huge pages (2 MiB on
/// x86-64) when it spans at least [`HUGE_PAGE_MIN_BYTES`]: a stream over such a buffer then
/// crosses a page, where the hardware prefetchers stop and start again, every 2 MiB instead of
/// every 4 KiB, and misses the TLB 512 times less often (a plain streaming sum over a decode
/// step's K and V measures markedly faster on huge pages). Only advice: the contents never change, and a kernel without THP (or
/// with it set to `never`) backs them as before; on other systems nothing is done. Called before
/// the pages are first written: the kernel backs a page when it is first touched.
fn advise_huge_pages<T>(v: &Vec<T>) {
    let bytes = v.capacity().saturating_mul(std::mem::size_of::<T>());
    if bytes < HUGE_PAGE_MIN_BYTES {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
        let start = v.as_ptr() as usize;
        let (lo, hi) = (start.next_multiple_of(page), (start + bytes) / page * page);
        if hi > lo {
            // SAFETY: the whole pages `lo..hi` lie inside `v`'s own allocation (capacity
            // `bytes` from `start`), and MADV_HUGEPAGE only changes how the kernel backs them,
            // never what they hold; an error (no THP in this kernel) leaves them as they were.
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
        }
    }
}

/// The `n` items of `items` in a vector allocated fallibly (as [`try_filled`]).
fn try_collect<T>(items: impl Iterator<Item = T>, n: usize, what: impl FnOnce() -> String) -> Result<Vec<T>> {
    let mut v = try_reserve(n, what)?;
    v.extend(items.take(n));
    Ok(v)
}

/// A vector of `n` copies of `fill`, allocated fallibly: a failed allocation (or a size past
/// `isize::MAX` bytes) is [`Error::TooLarge`] naming `what()`, never an abort.
pub(crate) fn try_filled<T: Clone>(n: usize, fill: T, what: impl FnOnce() -> String) -> Result<Vec<T>> {
    let mut v = try_reserve(n, what)?;
    v.resize(n, fill);
    Ok(v)
}

impl<'a> TensorView<'a> {
    /// A contiguous view of `data` as `shape = [batch, seqlen, heads, head_dim]`.
    ///
    /// The length is checked when the view is used (`forward` returns
    /// [`Error::InvalidLayout`]), so building a view never panics.
    pub fn new<T: Element>(data: &'a [T], shape: Shape) -> Self {
        let strides = contiguous_strides(shape).unwrap_or([usize::MAX; 3]);
        TensorView { data: T::wrap(data), shape, strides }
    }

    /// A strided view: `strides` are the element strides of batch, seqlen and heads
    /// (head_dim is contiguous). Validated when used.
    pub fn with_strides<T: Element>(data: &'a [T], shape: Shape, strides: [usize; 3]) -> Self {
        TensorView { data: T::wrap(data), shape, strides }
    }

    /// A view of `data` stored head-major, `[batch, heads, seqlen, head_dim]` (`bhsd`, the layout
    /// of torch's SDPA, onnxruntime's Attention and many engines' attention tensors), as the
    /// `[batch, seqlen, heads, head_dim]` tensor `forward` takes: strides `[heads·seqlen·head_dim,
    /// head_dim, seqlen·head_dim]`, no copy. The CPU backend then reads each head's contiguous
    /// rows in order. Validated when used, like [`TensorView::new`].
    pub fn heads_major<T: Element>(data: &'a [T], bhsd: Shape) -> Self {
        let [b, h, s, d] = bhsd;
        let strides = (|| Some([h.checked_mul(s)?.checked_mul(d)?, d, s.checked_mul(d)?]))();
        TensorView { data: T::wrap(data), shape: [b, s, h, d], strides: strides.unwrap_or([usize::MAX; 3]) }
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }
    pub fn strides(&self) -> [usize; 3] {
        self.strides
    }
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    pub fn data(&self) -> Data<'a> {
        self.data
    }
    pub fn batch(&self) -> usize {
        self.shape[0]
    }
    pub fn seqlen(&self) -> usize {
        self.shape[1]
    }
    pub fn heads(&self) -> usize {
        self.shape[2]
    }
    pub fn head_dim(&self) -> usize {
        self.shape[3]
    }

    /// Offset of row (b, s, h, 0).
    #[inline]
    pub(crate) fn offset(&self, b: usize, s: usize, h: usize) -> usize {
        b * self.strides[0] + s * self.strides[1] + h * self.strides[2]
    }

    /// Checks that every element the shape and strides address lies inside the buffer.
    pub(crate) fn check_layout(&self, operand: Operand) -> Result<()> {
        check_extent(operand, self.shape, self.strides, self.data.len())
    }

    /// Read row (b, s, h) widened to f32 into `dst` (length head_dim).
    #[inline]
    pub(crate) fn read_row(&self, b: usize, s: usize, h: usize, dst: &mut [f32]) {
        self.data.read_f32(self.offset(b, s, h), dst);
    }
}

/// An owned, contiguous host tensor `[batch, seqlen, heads, head_dim]`.
///
/// Checks that every element `shape` and `strides` (batch, seqlen, heads; head_dim contiguous)
/// address lies inside a buffer of `len` elements, with no dimension empty: the one layout rule
/// of host views and device tensors. Allocates nothing on success.
pub(crate) fn check_extent(operand: Operand, shape: Shape, strides: [usize; 3], len: usize) -> Result<()> {
    let [b, s, h, d] = shape;
    for (dim, n) in [("batch", b), ("seqlen", s), ("heads", h), ("head_dim", d)] {
        if n == 0 {
            return Err(Error::EmptyDimension { operand, dim });
        }
    }
    let last = [(b, strides[0]), (s, strides[1]), (h, strides[2])]
        .iter()
        .try_fold(d - 1, |acc, &(n, st)| (n - 1).checked_mul(st).and_then(|x| x.checked_add(acc)));
    match last {
        Some(last) if last < len => Ok(()),
        Some(last) => Err(Error::InvalidLayout {
            operand,
            reason: format!(
                "shape {shape:?} with strides {strides:?} reaches element {last}, but the buffer holds {len} elements"
            ),
        }),
        None => Err(Error::InvalidLayout {
            operand,
            reason: format!("shape {shape:?} with strides {strides:?} overflows usize"),
        }),
    }
}

/// Every constructor checks that the shape's element count, strides and size in bytes fit the
/// address space ([`Error::TooLarge`] otherwise, also when the allocation itself fails), so a
/// `Tensor` always has a valid view.
///
/// The buffers `Tensor::zeros` and `Tensor::from_f32` allocate (and `OwnedData::zeros`) are,
/// from 4 MiB up on Linux, advised for transparent huge pages as numpy advises its arrays: a
/// decode step streams K and V faster from them. An engine that allocates its own KV cache can
/// do the same (`madvise(MADV_HUGEPAGE)` before first writing it).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    data: OwnedData,
    shape: Shape,
    strides: [usize; 3],
}

impl Tensor {
    /// The checks every constructor makes: element count and strides of `shape` for `dtype`.
    fn checked(shape: Shape, dtype: DType) -> Result<(usize, [usize; 3])> {
        let n = check_size(shape, dtype.size(), "tensor")?;
        // check_size verified that the strides exist.
        Ok((n, contiguous_strides(shape).unwrap_or_default()))
    }

    /// Wrap a contiguous vector. Errors if `data.len()` is not the product of `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: Shape) -> Result<Self> {
        let (n, strides) = Self::checked(shape, T::DTYPE)?;
        if data.len() != n {
            return Err(Error::ShapeMismatch {
                what: "Tensor::from_vec".into(),
                got: format!("{} elements", data.len()),
                expected: format!("{n} elements for shape {shape:?}"),
            });
        }
        Ok(Tensor { data: T::wrap_owned(data), shape, strides })
    }

    /// A zero tensor of the given type and shape.
    pub fn zeros(dtype: DType, shape: Shape) -> Result<Self> {
        let (n, strides) = Self::checked(shape, dtype)?;
        Ok(Tensor { data: OwnedData::zeros(dtype, n)?, shape, strides })
    }

    /// Elements widened to f32 (contiguous order). The length is checked before anything is
    /// allocated.
    pub fn from_f32(values: &[f32], dtype: DType, shape: Shape) -> Result<Self> {
        let (n, _) = Self::checked(shape, dtype)?;
        if values.len() != n {
            return Err(Error::ShapeMismatch {
                what: "Tensor::from_f32".into(),
                got: format!("{} elements", values.len()),
                expected: format!("{n} elements for shape {shape:?}"),
            });
        }
        let (_, strides) = Self::checked(shape, dtype)?;
        let what = || format!("tensor of shape {shape:?}");
        let data = match dtype {
            DType::F32 => OwnedData::F32(try_collect(values.iter().copied(), n, what)?),
            DType::F16 => OwnedData::F16(try_collect(values.iter().map(|&x| f16::from_f32(x)), n, what)?),
            DType::BF16 => OwnedData::BF16(try_collect(values.iter().map(|&x| bf16::from_f32(x)), n, what)?),
        };
        Ok(Tensor { data, shape, strides })
    }

    pub fn view(&self) -> TensorView<'_> {
        TensorView { data: self.data.as_data(), shape: self.shape, strides: self.strides }
    }
    pub fn shape(&self) -> Shape {
        self.shape
    }
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    pub fn numel(&self) -> usize {
        self.data.as_data().len()
    }
    pub fn data(&self) -> &OwnedData {
        &self.data
    }
    /// The owned buffer (contiguous `[batch, seqlen, heads, head_dim]`), without a copy.
    pub fn into_data(self) -> OwnedData {
        self.data
    }
    /// The elements as a `Vec<T>` (contiguous order), without a copy.
    ///
    /// # Errors
    /// [`Error::UnsupportedDType`] when `T` is not the tensor's element type.
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>> {
        let have = self.dtype();
        T::unwrap_owned(self.data).map_err(|_| Error::UnsupportedDType {
            dtype: T::DTYPE,
            backend: "Tensor::into_vec (the tensor's element type)".into(),
            supported: format!("{have:?}"),
        })
    }
    pub(crate) fn data_mut(&mut self) -> &mut OwnedData {
        &mut self.data
    }
    /// All elements widened to f32, contiguous order (an infallible copy, like `Vec::clone`: at
    /// most twice the tensor's own size).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let d = self.data.as_data();
        (0..d.len()).map(|i| d.get_f32(i)).collect()
    }
}

/// Anything `forward` accepts as an input tensor.
pub trait AsTensorView {
    fn as_view(&self) -> TensorView<'_>;
}

impl AsTensorView for Tensor {
    fn as_view(&self) -> TensorView<'_> {
        self.view()
    }
}

impl AsTensorView for TensorView<'_> {
    fn as_view(&self) -> TensorView<'_> {
        *self
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The `VmFlags` of the mapping of `/proc/self/smaps` that holds address `at`.
    fn vm_flags(at: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        let hex = |x: &str| usize::from_str_radix(x, 16).ok();
        for line in smaps.lines() {
            // A mapping's first line starts with its range, `lo-hi` in hex.
            let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
            if let Some((lo, hi)) = range.and_then(|(a, b)| Some((hex(a)?, hex(b)?))) {
                inside = (lo..hi).contains(&at);
            } else if inside && line.starts_with("VmFlags:") {
                return Some(line.to_string());
            }
        }
        None
    }

    /// Whether the mapping holding the middle of `v` (a whole huge page inside the buffer, away
    /// from the ends the heap may share) is advised for huge pages.
    fn advised(v: &[f32]) -> bool {
        let mid = v.as_ptr() as usize + std::mem::size_of_val(v) / 2;
        let flags = vm_flags(mid).expect("the buffer lies in a mapping of /proc/self/smaps");
        flags.split_whitespace().any(|f| f == "hg")
    }

    /// A large tensor's pages are advised for huge pages (`hg` in the flags of its mapping) where
    /// the kernel has transparent huge pages, and are not where it has none (madvise fails); the
    /// contents are what was asked for either way.
    #[test]
    fn large_tensors_are_advised_for_huge_pages() {
        let n = 3 * HUGE_PAGE_MIN_BYTES / 4; // f32: 3 × the threshold
        let t = Tensor::zeros(DType::F32, [1, n / 1024, 8, 128]).expect("allocates");
        let OwnedData::F32(v) = t.data() else { panic!("f32") };
        assert!(v.iter().all(|&x| x == 0.0));
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        assert_eq!(advised(v), thp, "Tensor::zeros");
        let w = Tensor::from_f32(&vec![1.5f32; n], DType::F32, [1, n / 1024, 8, 128]).expect("allocates");
        let OwnedData::F32(w) = w.data() else { panic!("f32") };
        assert!(w.iter().all(|&x| x == 1.5));
        assert_eq!(advised(w), thp, "Tensor::from_f32");
    }
}
