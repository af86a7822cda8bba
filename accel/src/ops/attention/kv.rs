//! The element types of the KV cache: the runtime tag [`KvDtype`], the
//! sealed [`KvElem`] trait of the three storable types, and the raw view
//! ([`KvView`]) the kernels widen from.

use half::{bf16, f16, slice::HalfFloatSliceExt};

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// 32-bit float: exact, twice the memory of the 16-bit types.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16: f32's range with 8 bits of mantissa.
    Bf16,
}

impl KvDtype {
    /// Bytes per stored element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
}

mod sealed {
    /// The cache reinterpreted as raw storage, so kernels can widen it with
    /// SIMD instead of element by element through [`super::KvElem::to_f32`].
    #[derive(Clone, Copy)]
    pub enum KvView<'a> {
        F32(&'a [f32]),
        F16(&'a [u16]),
        Bf16(&'a [u16]),
    }

    impl KvView<'_> {
        /// Address of element `i` (for prefetching; not dereferenced).
        #[inline(always)]
        pub fn addr(&self, i: usize) -> *const u8 {
            match *self {
                KvView::F32(s) => s.as_ptr().wrapping_add(i) as *const u8,
                KvView::F16(s) | KvView::Bf16(s) => s.as_ptr().wrapping_add(i) as *const u8,
            }
        }
    }

    /// Keeps [`super::KvElem`] to the three types the kernels know how to
    /// read (the trait is public, its implementations are not open).
    pub trait Sealed: Sized {
        fn view(s: &[Self]) -> KvView<'_>;
    }
}
pub(super) use sealed::KvView;

/// A type the KV cache can be stored in: `f32`, [`half::f16`] or
/// [`half::bf16`].
pub trait KvElem: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The runtime tag of this type.
    const DTYPE: KvDtype;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// [`KvElem::from_f32`] of each element of `src` into `dst` (of equal
    /// length), vectorized where the type allows.
    fn from_f32_slice(dst: &mut [Self], src: &[f32]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = Self::from_f32(x);
        }
    }
}

impl sealed::Sealed for f32 {
    fn view(s: &[f32]) -> KvView<'_> {
        KvView::F32(s)
    }
}
impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    #[inline]
    fn from_f32(x: f32) -> f32 {
        x
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32_slice(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
}

impl sealed::Sealed for f16 {
    fn view(s: &[f16]) -> KvView<'_> {
        KvView::F16(bytemuck::cast_slice(s))
    }
}
impl KvElem for f16 {
    const DTYPE: KvDtype = KvDtype::F16;
    #[inline]
    fn from_f32(x: f32) -> f16 {
        f16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32_slice(dst: &mut [f16], src: &[f32]) {
        // F16C, 8 at a time, with the same rounding as `f16::from_f32`.
        dst.convert_from_f32_slice(src);
    }
}

impl sealed::Sealed for bf16 {
    fn view(s: &[bf16]) -> KvView<'_> {
        KvView::Bf16(bytemuck::cast_slice(s))
    }
}
impl KvElem for bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
    #[inline]
    fn from_f32(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
