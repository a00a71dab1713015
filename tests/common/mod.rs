//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lily::checkpoint::safetensors::open_file;
use lily::checkpoint::tensor::{DType, RawTensor};
use lily::model::weights::Matrix;

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// The transformers reference outputs of one fixture model.
pub struct Reference {
    tensors: BTreeMap<String, RawTensor>,
}

impl Reference {
    pub fn load(model: &str) -> Reference {
        Reference {
            tensors: open_file(&fixture_dir(model).join("reference.safetensors"))
                .expect("reference fixture"),
        }
    }
    pub fn prompts(&self) -> usize {
        self.tensors.keys().filter(|k| k.ends_with(".ids")).count()
    }
    pub fn ids(&self, p: usize, what: &str) -> Vec<u32> {
        let t = &self.tensors[&format!("p{p}.{what}")];
        assert_eq!(t.dtype, DType::I32);
        t.data
            .as_slice()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
    pub fn f32s(&self, p: usize, what: &str) -> Vec<f32> {
        let name = format!("p{p}.{what}");
        self.tensors[&name].to_f32(&name).unwrap()
    }
}

/// max |a − b| / max |b|: the error relative to the scale of the reference.
pub fn rel_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// ‖a − b‖ / ‖b‖: the RMS error relative to the reference's RMS.
pub fn rel_rms(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let (e, n) = a.iter().zip(b).fold((0f64, 0f64), |(e, n), (x, y)| {
        (e + ((x - y) as f64).powi(2), n + (*y as f64).powi(2))
    });
    (e / n).sqrt() as f32
}

/// Every row of a matrix, decoded to f32.
pub fn matrix_values(m: &Matrix) -> Vec<f32> {
    let mut out = vec![0f32; m.rows * m.cols];
    for (r, row) in out.chunks_mut(m.cols).enumerate() {
        m.row_into(r, row);
    }
    out
}

/// Applies `f` to every matrix of `w` (to re-encode a model in another format).
pub fn map_matrices(w: &mut lily::model::Weights, mut f: impl FnMut(&mut Matrix)) {
    use lily::model::weights::Mixer;
    f(&mut w.embed);
    f(&mut w.lm_head);
    for l in &mut w.layers {
        match &mut l.mixer {
            Mixer::DeltaNet(d) => {
                for m in [
                    &mut d.in_proj_qkv,
                    &mut d.in_proj_z,
                    &mut d.in_proj_b,
                    &mut d.in_proj_a,
                    &mut d.out_proj,
                ] {
                    f(m);
                }
            }
            Mixer::Attention(a) => {
                for m in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
                    f(m);
                }
            }
        }
        let m = &mut l.moe;
        f(&mut m.router);
        f(&mut m.shared_expert_gate);
        for x in m.experts.iter_mut().chain([&mut m.shared_expert]) {
            f(&mut x.gate);
            f(&mut x.up);
            f(&mut x.down);
        }
    }
}

#[allow(unused_imports)]
pub use lily::model::argmax;

/// Rewrites a safetensors file's tensors through `edit` (name, dtype, shape, bytes): how the tests
/// make broken checkpoints.
pub fn rewrite(file: &Path, edit: impl Fn(&mut Vec<(String, DType, Vec<usize>, Vec<u8>)>)) {
    let tensors = open_file(file).unwrap();
    let mut list: Vec<_> = tensors
        .into_iter()
        .map(|(n, t)| (n, t.dtype, t.shape.clone(), t.data.as_slice().to_vec()))
        .collect();
    edit(&mut list);
    lily::checkpoint::safetensors::write_file(file, &list).unwrap();
}
