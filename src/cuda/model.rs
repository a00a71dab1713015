//! The model in device memory, laid out for the kernels: projections that read the same input
//! are concatenated (GDN `qkv‖z‖b‖a`, attention `q(+gate)‖k‖v`, router‖shared-expert gate), and
//! each layer's experts, the shared one last, form one stack of `gate‖up` and one of `down`,
//! addressed by expert id.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::synth::SynthKernels;
use super::weights::{htod, DeviceFp8, DeviceMatrices};
use super::{ensure, Context, CudaDevice, CudaStream, Result};
use crate::config::{LayerKind, ModelConfig};
use crate::model::convert;
use crate::model::weights::{Mixer, MoeWeights, Weights};

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

/// A layer's MoE block. The shared expert is stored as expert `num_experts` of the stacks and
/// its gate as the router's last row, so that decode runs it in the same launches as the 8 routed
/// experts (9 slots), with weight sigmoid(gate) (MODEL.md §3.7).
pub struct DeviceMoe {
    /// `[num_experts + 1][hidden]`: the router's rows, then the shared expert's gate.
    pub router: DeviceMatrices,
    /// `num_experts + 1` × `[2·I][hidden]` (gate rows, then up rows); the last is the shared expert.
    pub gate_up: DeviceMatrices,
    /// `num_experts + 1` × `[hidden][I]`.
    pub down: DeviceMatrices,
    /// An FP8 checkpoint's expert stacks as they ship, for long prefill chunks on the FP8 tensor
    /// cores (gemm_fp8.rs); the stacks above are their affine Q8 conversion, for decode.
    pub fp8: Option<DeviceFp8Moe>,
}

/// The same stacks as DeviceMoe's `gate_up` and `down`, in e4m3 with 128 × 128 block scales.
pub struct DeviceFp8Moe {
    pub gate_up: DeviceFp8,
    pub down: DeviceFp8,
}

impl DeviceFp8Moe {
    /// The layer's expert stacks, if every expert matrix (the shared one too) is FP8 in whole
    /// 128 × 128 blocks; `None` otherwise, or when `LILY_FP8_PREFILL=0` (no second copy: ≈ 0.8 GB
    /// a layer at the full shape).
    pub fn upload(s: &Arc<CudaStream>, m: &MoeWeights) -> Result<Option<Self>> {
        if std::env::var("LILY_FP8_PREFILL").is_ok_and(|v| v == "0") {
            return Ok(None);
        }
        let experts = || m.experts.iter().chain([&m.shared_expert]);
        let gate_ups: Vec<_> = experts().map(|e| vec![&e.gate, &e.up]).collect();
        let downs: Vec<_> = experts().map(|e| vec![&e.down]).collect();
        let gate_up = DeviceFp8::stack_of_concats(s, &gate_ups)?;
        let down = DeviceFp8::stack_of_concats(s, &downs)?;
        Ok(gate_up
            .zip(down)
            .map(|(gate_up, down)| DeviceFp8Moe { gate_up, down }))
    }

    fn bytes(&self) -> usize {
        self.gate_up.bytes() + self.down.bytes()
    }
}

impl DeviceMoe {
    /// Copies one layer's MoE weights to the device in this layout.
    pub fn upload(s: &Arc<CudaStream>, c: &ModelConfig, m: &MoeWeights) -> Result<Self> {
        let shared = &m.shared_expert;
        check_shared_expert(c)?;
        let experts = || m.experts.iter().chain([shared]);
        let gate_ups: Vec<_> = experts().map(|e| vec![&e.gate, &e.up]).collect();
        let downs: Vec<_> = experts().map(|e| vec![&e.down]).collect();
        Ok(DeviceMoe {
            router: DeviceMatrices::concat(s, &[&m.router, &m.shared_expert_gate])?,
            gate_up: DeviceMatrices::stack_of_concats(s, &gate_ups)?,
            down: DeviceMatrices::stack_of_concats(s, &downs)?,
            fp8: None,
        })
    }
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
    /// blocks and FP8 tiles (or matrices stored together in different formats) converted to
    /// affine Q8 first (see [`crate::model::convert`]; the conversion error is logged). FP8
    /// expert stacks are kept as they ship too, for prefill ([`DeviceFp8Moe`]).
    pub fn upload(dev: &CudaDevice, w: &Weights) -> Result<Self> {
        let original = w;
        let converted;
        let w = if convert::ready_for_kernels(w) {
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
        for (l, o) in w.layers.iter().zip(&original.layers) {
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
            let mut moe = DeviceMoe::upload(s, &w.config, &l.moe)?;
            moe.fp8 = DeviceFp8Moe::upload(s, &o.moe)?;
            layers.push(DeviceLayer {
                input_norm: htod(s, &l.input_norm)?,
                post_norm: htod(s, &l.post_attention_norm)?,
                mixer,
                moe,
            });
        }
        let model = CudaModel {
            config: w.config.clone(),
            embed: DeviceMatrices::concat(s, &[&w.embed])?,
            lm_head: DeviceMatrices::concat(s, &[&w.lm_head])?,
            final_norm: htod(s, &w.final_norm)?,
            layers,
        };
        weights_ready(s)?;
        Ok(model)
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
        Self::synthetic_with(dev, config, bits, false, seed)
    }

    /// As an FP8 checkpoint runs: the synthetic model at 8 bits, plus FP8 expert stacks of their
    /// own random values for prefill (for speed only: prefill and decode then use different
    /// experts).
    pub fn synthetic_fp8(dev: &CudaDevice, config: ModelConfig, seed: u64) -> Result<Self> {
        Self::synthetic_with(dev, config, Some(8), true, seed)
    }

    fn synthetic_with(
        dev: &CudaDevice,
        config: ModelConfig,
        bits: Option<u32>,
        fp8: bool,
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
            check_shared_expert(c)?;
            let (e, inter) = (c.num_experts + 1, c.moe_intermediate_size);
            let moe = DeviceMoe {
                router: k.matrices(small_bits, 1, e, h, next())?,
                gate_up: k.matrices(bits, e, 2 * inter, h, next())?,
                down: k.matrices(bits, e, h, inter, next())?,
                fp8: if fp8 {
                    Some(DeviceFp8Moe {
                        gate_up: k.fp8_matrices(e, 2 * inter, h, next())?,
                        down: k.fp8_matrices(e, h, inter, next())?,
                    })
                } else {
                    None
                },
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
        let model = CudaModel {
            embed: k.matrices(bits, 1, c.vocab_size, h, next())?,
            lm_head: k.matrices(bits, 1, c.vocab_size, h, next())?,
            final_norm: ones(h)?,
            layers,
            config,
        };
        weights_ready(s)?;
        Ok(model)
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
            let fp8 = m.fp8.as_ref().map_or(0, DeviceFp8Moe::bytes);
            mixer + m.router.bytes() + m.gate_up.bytes() + m.down.bytes() + fp8
        });
        self.embed.bytes() + self.lm_head.bytes() + mats.sum::<usize>()
    }
}

/// The shared expert joins the routed experts' stacks (DeviceMoe), so it must have their width, as
/// Qwen3.6-35B-A3B's does (512); formats are made common by `convert` before upload, and the
/// stack itself rejects a mismatch.
fn check_shared_expert(c: &ModelConfig) -> Result<()> {
    ensure!(
        c.shared_expert_intermediate_size == c.moe_intermediate_size,
        "the CUDA backend runs the shared expert beside the routed ones: it needs their width ({}), \
         the checkpoint has {}",
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size
    );
    Ok(())
}

/// Waits until every weight is in place. The GEMVs stream weights before their PDL wait
/// (pdl.rs), which is safe only for data that no kernel still in the stream writes.
fn weights_ready(s: &Arc<CudaStream>) -> Result<()> {
    s.synchronize()
        .during(|| "waiting for the weights to reach the GPU".into())
}
