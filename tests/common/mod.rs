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

/// A config with Qwen3.6-35B-A3B's GDN and attention head shapes (what the CUDA kernels are built
/// for) but 4 layers of the given kinds, 16 experts, hidden 512 and a 2048-token vocabulary: small
/// enough for the CPU reference, and every kernel of the real model runs.
pub fn real_shaped_config(layer_types: [&str; 4]) -> serde_json::Value {
    let mut c = lily::checkpoint::synth::preset("qwen3.6-35b-a3b").unwrap();
    let t = c["text_config"].as_object_mut().unwrap();
    t.insert("hidden_size".into(), serde_json::json!(512));
    t.insert("num_hidden_layers".into(), serde_json::json!(4));
    t.insert("layer_types".into(), serde_json::json!(layer_types));
    t.insert("num_experts".into(), serde_json::json!(16));
    t.insert("moe_intermediate_size".into(), serde_json::json!(256));
    t.insert(
        "shared_expert_intermediate_size".into(),
        serde_json::json!(256),
    );
    t.insert("vocab_size".into(), serde_json::json!(2048));
    t.insert("mtp_num_hidden_layers".into(), serde_json::json!(0));
    c
}

/// splitmix64 for test data: fast, and reproducible from the seed it prints (fresh each run;
/// LILY_TEST_SEED repeats one).
pub struct Rng(u64);

impl Rng {
    pub fn new(test: &str) -> Self {
        let seed = std::env::var("LILY_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        println!("{test}: seed {seed}");
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1), 53 bits (as the samplers' draws).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let (a, b) = (self.uniform().max(1e-300), self.uniform());
        (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
    }
    pub fn pick<T: Copy>(&mut self, options: &[T]) -> T {
        options[self.below(options.len())]
    }
    pub fn bf16s(&mut self, n: usize, scale: f32) -> Vec<half::bf16> {
        (0..n)
            .map(|_| half::bf16::from_f32(self.unit() * scale))
            .collect()
    }
    pub fn words(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.next_u64() as u32).collect()
    }
}
