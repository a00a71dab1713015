//! The model in device memory, laid out for the kernels: projections that read the same input
//! are concatenated (GDN `qkv‖z‖b‖a`, attention `q(+gate)‖k‖v`, shared expert `gate‖up`), and
//! each layer's experts form one stack of `gate‖up` and one of `down`, addressed by expert id.

use cudarc::driver::CudaSlice;

use super::synth::SynthKernels;
use super::weights::{htod, DeviceMatrices};
use super::{ensure, CudaDevice, Result};
use crate::config::{LayerKind, ModelConfig};
use crate::model::convert;
use crate::model::weights::{Mixer, Weights};

pub enum DeviceMixer {
    DeltaNet {
        /// `[conv_dim + value_dim + 2·value_heads][hidden]`: in_proj_qkv ‖ z ‖ b ‖ a.
        in_proj: DeviceMatrices,
        out_proj: DeviceMatrices,
        conv_w: CudaSlice<f32>,
        a_log: CudaSlice<f32>,
        dt_bias: CudaSlice<f32>,
        norm: CudaSlice<f32>,
    },
    Attention {
        /// `[16·512 + 2·256 + 2·256][hidden]`: q_proj ‖ k_proj ‖ v_proj.
        qkv: DeviceMatrices,
        o_proj: DeviceMatrices,
        q_norm: CudaSlice<f32>,
        k_norm: CudaSlice<f32>,
    },
}

pub struct DeviceMoe {
    pub router: DeviceMatrices,
    /// `num_experts` × `[2·I][hidden]` (gate rows, then up rows).
    pub gate_up: DeviceMatrices,
    /// `num_experts` × `[hidden][I]`.
    pub down: DeviceMatrices,
    pub shared_gate_up: DeviceMatrices,
    pub shared_down: DeviceMatrices,
    /// `[1][hidden]`.
    pub shared_gate: DeviceMatrices,
}

pub struct DeviceLayer {
    pub input_norm: CudaSlice<f32>,
    pub post_norm: CudaSlice<f32>,
    pub mixer: DeviceMixer,
    pub moe: DeviceMoe,
}

pub struct CudaModel {
    pub config: ModelConfig,
    pub embed: DeviceMatrices,
    pub lm_head: DeviceMatrices,
    pub final_norm: CudaSlice<f32>,
    pub layers: Vec<DeviceLayer>,
}

impl CudaModel {
    /// Copies canonical weights to the device: bf16 and MLX affine matrices as they are, GGUF
    /// blocks and FP8 tiles converted to affine Q8 first (see [`crate::model::convert`]; the
    /// conversion error is logged).
    pub fn upload(dev: &CudaDevice, w: &Weights) -> Result<Self> {
        let converted;
        let w = if w.matrices().iter().all(|(_, m)| convert::kernel_ready(m)) {
            w
        } else {
            let report;
            (converted, report) = convert::weights_for_kernels(w);
            for line in report.lines() {
                tracing::info!("weights converted for the CUDA kernels: {line}");
            }
            &converted
        };
        let s = dev.stream();
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let mixer = match &l.mixer {
                Mixer::DeltaNet(d) => DeviceMixer::DeltaNet {
                    in_proj: DeviceMatrices::concat(
                        s,
                        &[&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_b, &d.in_proj_a],
                    )?,
                    out_proj: DeviceMatrices::concat(s, &[&d.out_proj])?,
                    conv_w: htod(s, &d.conv1d)?,
                    a_log: htod(s, &d.a_log)?,
                    dt_bias: htod(s, &d.dt_bias)?,
                    norm: htod(s, &d.norm)?,
                },
                Mixer::Attention(a) => DeviceMixer::Attention {
                    qkv: DeviceMatrices::concat(s, &[&a.q_proj, &a.k_proj, &a.v_proj])?,
                    o_proj: DeviceMatrices::concat(s, &[&a.o_proj])?,
                    q_norm: htod(s, &a.q_norm)?,
                    k_norm: htod(s, &a.k_norm)?,
                },
            };
            let m = &l.moe;
            let experts: Vec<_> = m.experts.iter().map(|e| vec![&e.gate, &e.up]).collect();
            let downs: Vec<_> = m.experts.iter().map(|e| vec![&e.down]).collect();
            let moe = DeviceMoe {
                router: DeviceMatrices::concat(s, &[&m.router])?,
                gate_up: DeviceMatrices::stack_of_concats(s, &experts)?,
                down: DeviceMatrices::stack_of_concats(s, &downs)?,
                shared_gate_up: DeviceMatrices::concat(
                    s,
                    &[&m.shared_expert.gate, &m.shared_expert.up],
                )?,
                shared_down: DeviceMatrices::concat(s, &[&m.shared_expert.down])?,
                shared_gate: DeviceMatrices::concat(s, &[&m.shared_expert_gate])?,
            };
            layers.push(DeviceLayer {
                input_norm: htod(s, &l.input_norm)?,
                post_norm: htod(s, &l.post_attention_norm)?,
                mixer,
                moe,
            });
        }
        Ok(CudaModel {
            config: w.config.clone(),
            embed: DeviceMatrices::concat(s, &[&w.embed])?,
            lm_head: DeviceMatrices::concat(s, &[&w.lm_head])?,
            final_norm: htod(s, &w.final_norm)?,
            layers,
        })
    }

    /// Random weights generated on the device: matrices bf16 (`bits` None) or affine `bits`-bit
    /// (router and shared-expert gate 8-bit, as MLX quantises them); norms 1, A_log = ln 4,
    /// dt_bias 1, conv taps 0.25.
    pub fn synthetic(
        dev: &CudaDevice,
        config: ModelConfig,
        bits: Option<u32>,
        seed: u64,
    ) -> Result<Self> {
        let k = SynthKernels::load(dev)?;
        let s = dev.stream();
        let c = &config;
        let h = c.hidden_size;
        let small_bits = bits.map(|_| 8);
        let mut seed = seed;
        let mut next = || {
            seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            seed
        };
        let ones = |n: usize| htod(s, &vec![1f32; n]);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let mixer = match c.layer_types[i] {
                LayerKind::LinearAttention => {
                    let rows = c.conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads;
                    DeviceMixer::DeltaNet {
                        in_proj: k.matrices(bits, 1, rows, h, next())?,
                        out_proj: k.matrices(bits, 1, h, c.linear_value_dim(), next())?,
                        conv_w: htod(s, &vec![0.25f32; c.conv_dim() * c.linear_conv_kernel_dim])?,
                        a_log: htod(s, &vec![4f32.ln(); c.linear_num_value_heads])?,
                        dt_bias: ones(c.linear_num_value_heads)?,
                        norm: ones(c.linear_value_head_dim)?,
                    }
                }
                LayerKind::FullAttention => {
                    let rows = 2 * c.num_attention_heads * c.head_dim
                        + 2 * c.num_key_value_heads * c.head_dim;
                    DeviceMixer::Attention {
                        qkv: k.matrices(bits, 1, rows, h, next())?,
                        o_proj: k.matrices(
                            bits,
                            1,
                            h,
                            c.num_attention_heads * c.head_dim,
                            next(),
                        )?,
                        q_norm: ones(c.head_dim)?,
                        k_norm: ones(c.head_dim)?,
                    }
                }
            };
            let (inter, si) = (c.moe_intermediate_size, c.shared_expert_intermediate_size);
            let moe = DeviceMoe {
                router: k.matrices(small_bits, 1, c.num_experts, h, next())?,
                gate_up: k.matrices(bits, c.num_experts, 2 * inter, h, next())?,
                down: k.matrices(bits, c.num_experts, h, inter, next())?,
                shared_gate_up: k.matrices(bits, 1, 2 * si, h, next())?,
                shared_down: k.matrices(bits, 1, h, si, next())?,
                shared_gate: k.matrices(small_bits, 1, 1, h, next())?,
            };
            layers.push(DeviceLayer {
                input_norm: ones(h)?,
                post_norm: ones(h)?,
                mixer,
                moe,
            });
        }
        ensure!(
            !c.tie_word_embeddings,
            "synthetic models have an untied LM head"
        );
        Ok(CudaModel {
            embed: k.matrices(bits, 1, c.vocab_size, h, next())?,
            lm_head: k.matrices(bits, 1, c.vocab_size, h, next())?,
            final_norm: ones(h)?,
            layers,
            config,
        })
    }

    /// Bytes of weights on the device.
    pub fn bytes(&self) -> usize {
        let mats = self.layers.iter().map(|l| {
            let mixer = match &l.mixer {
                DeviceMixer::DeltaNet {
                    in_proj, out_proj, ..
                } => in_proj.bytes() + out_proj.bytes(),
                DeviceMixer::Attention { qkv, o_proj, .. } => qkv.bytes() + o_proj.bytes(),
            };
            let m = &l.moe;
            mixer
                + m.router.bytes()
                + m.gate_up.bytes()
                + m.down.bytes()
                + m.shared_gate_up.bytes()
                + m.shared_down.bytes()
                + m.shared_gate.bytes()
        });
        self.embed.bytes() + self.lm_head.bytes() + mats.sum::<usize>()
    }
}
