//! A projection whose output is several logical matrices side by side.

use anyhow::Result;
use pagoda_accel::{Backend, DeviceMatrix, HostMatrix, LoraSlice, Rows};

/// Several logical matrices read from one input and written side by side
/// (q|k|v, or gate|up). Fused into one matrix when the parts share a
/// storage type and read their input alike, so the device runs one matmul
/// instead of several.
pub enum Projection<B: Backend> {
    Fused(B::Matrix),
    Split(Vec<B::Matrix>),
}

impl<B: Backend> Projection<B> {
    /// Uploads `parts` to `backend`'s device, fused where they can be.
    pub fn new(backend: &B, parts: Vec<HostMatrix<'_>>) -> Result<Projection<B>> {
        if HostMatrix::can_concat(&parts) {
            let fused = HostMatrix::concat_rows(&parts)?;
            Ok(Projection::Fused(backend.upload_matrix(&fused)?))
        } else {
            let mut up = Vec::with_capacity(parts.len());
            for p in &parts {
                up.push(backend.upload_matrix(p)?);
            }
            Ok(Projection::Split(up))
        }
    }

    /// out: `[m, Σ rows]`, each row the parts' outputs side by side. `tmp`
    /// holds one part's output when the parts are split (at least
    /// [`Projection::split_width`] columns).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        b: &mut B,
        x: &B::Buffer,
        m: usize,
        out: &mut B::Buffer,
        tmp: &mut B::Buffer,
        step: &B::Step,
    ) -> Result<(), pagoda_accel::BackendError> {
        match self {
            Projection::Fused(w) => b.matmul(w, x, m, out, step, Rows::Tokens),
            Projection::Split(parts) => {
                let width: usize = parts.iter().map(|p| p.rows()).sum();
                b.reserve(tmp, m * self.split_width())?;
                let mut col = 0;
                for p in parts {
                    b.matmul(p, x, m, tmp, step, Rows::Tokens);
                    b.copy_columns(tmp, p.rows(), 0, out, width, col, p.rows(), m);
                    col += p.rows();
                }
            }
        }
        Ok(())
    }

    /// [`Projection::matmul`], then `bias`, then the LoRA deltas of
    /// `slices` (columns of the whole output): one
    /// [`Backend::matmul_lora`] when fused, so the deltas can run beside
    /// the matmul.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_lora(
        &self,
        b: &mut B,
        x: &B::Buffer,
        m: usize,
        out: &mut B::Buffer,
        tmp: &mut B::Buffer,
        bias: Option<&B::Vector>,
        slices: &[LoraSlice<'_, B::Matrix>],
        step: &B::Step,
    ) -> Result<(), pagoda_accel::BackendError> {
        match self {
            Projection::Fused(w) => b.matmul_lora(w, x, m, out, bias, slices, step),
            Projection::Split(_) => {
                self.matmul(b, x, m, out, tmp, step)?;
                let width: usize = self.parts().iter().map(|p| p.rows()).sum();
                if let Some(bias) = bias {
                    b.add_bias(out, bias, m, width);
                }
                let in_dim = self.parts().first().map_or(0, |p| p.cols());
                for s in slices {
                    b.lora_add(x, in_dim, s.slots, step, out, width, s.col, s.out_dim)?;
                }
                Ok(())
            }
        }
    }

    /// The matrices on the device.
    pub fn parts(&self) -> &[B::Matrix] {
        match self {
            Projection::Fused(w) => std::slice::from_ref(w),
            Projection::Split(p) => p,
        }
    }

    /// The widest split part (0 when fused).
    pub fn split_width(&self) -> usize {
        match self {
            Projection::Fused(_) => 0,
            Projection::Split(p) => p.iter().map(|m| m.rows()).max().unwrap_or(0),
        }
    }

    /// Bytes on the device.
    pub fn size_bytes(&self) -> usize {
        self.parts().iter().map(|p| p.size_bytes()).sum()
    }
}
