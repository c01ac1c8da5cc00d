//! Plain host-side helpers on row-major `f32` matrices (`Vec<f32>` in CPU memory), shared by the
//! layers and the kept-quantized base.

/// Transposes a row-major `[rows, cols]` matrix.
pub(crate) fn transpose_host(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}
