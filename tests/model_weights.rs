//! Canonical matrices (src/model/weights.rs): a column range of a matrix is a matrix of its
//! own whose every row decodes to that range of the source row (the MTP head's `fc` is cut so).

mod common;

use common::{matrix_values, Rng};
use lily::checkpoint::tensor::{Bytes, DType};
use lily::model::weights::{Matrix, WeightFormat};
use lily::quant::{self, Affine};

fn affine(values: &[f32], cols: usize, bits: u32) -> Matrix {
    let q = Affine::new(bits, 64).unwrap();
    let packed = quant::quantize(values, cols, q, DType::BF16).unwrap();
    Matrix {
        rows: values.len() / cols,
        cols,
        format: WeightFormat::Affine {
            bits,
            group_size: 64,
        },
        data: Bytes::from_vec(packed.packed),
        scales: Some(Bytes::from_vec(packed.scales)),
        biases: Some(Bytes::from_vec(packed.biases)),
        scale_dtype: DType::BF16,
    }
}

fn bf16(values: &[f32], cols: usize) -> Matrix {
    let bytes = values
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    Matrix::dense(
        values.len() / cols,
        cols,
        DType::BF16,
        Bytes::from_vec(bytes),
    )
}

#[test]
fn column_ranges_decode_to_the_rows_ranges() {
    let mut rng = Rng::new("column_ranges_decode_to_the_rows_ranges");
    let (rows, cols) = (3 + rng.below(5), 64 * (2 + rng.below(4)));
    let values: Vec<f32> = (0..rows * cols).map(|_| rng.unit()).collect();
    let matrices = [
        Matrix::from_f32(rows, cols, &values),
        bf16(&values, cols),
        affine(&values, cols, 4),
        affine(&values, cols, 8),
    ];
    for m in &matrices {
        let all = matrix_values(m);
        for (start, n) in [(0, 64), (64, cols - 64), (cols - 128, 64), (0, cols)] {
            let part = m.columns(start, n).expect("a cut on whole groups");
            assert_eq!((part.rows, part.cols, part.format), (rows, n, m.format));
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| all[r * cols + start..r * cols + start + n].iter().copied())
                .collect();
            assert!(
                matrix_values(&part) == want,
                "{:?}: columns {start}..{}",
                m.format,
                start + n
            );
        }
    }
    // Dense formats cut anywhere; affine ones only on whole groups.
    assert!(matrices[0].columns(3, 5).is_some());
    assert!(matrices[2].columns(32, 64).is_none());
    assert!(matrices[3].columns(0, 96).is_none());
}
