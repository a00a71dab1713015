//! The model in device memory, laid out for the kernels: projections that read the same input
//! are concatenated (GDN `qkv‖z‖b‖a`, attention `q(+gate)‖k‖v`, router‖shared-expert gate), and
//! each layer's experts, the shared one last, form one stack of `gate‖up` and one of `down`,
//! addressed by expert id.

use std::sync::Arc;

use cudarc::driver::CudaSlice;

use super::synth::SynthKernels;
use super::weights::{htod, DeviceMatrices};
use super::{ensure, Context, CudaDevice, CudaError, CudaStream, Result};
use crate::config::{LayerKind, ModelConfig};
use crate::model::convert;
use crate::model::weights::{LayerWeights, Matrix, Mixer, MoeWeights, MtpWeights, Weights};

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
}

impl DeviceMoe {
    /// Copies one layer's MoE weights to the device in this layout.
    pub fn upload(s: &Arc<CudaStream>, c: &ModelConfig, m: &MoeWeights) -> Result<Self> {
        Self::upload_converted(s, c, m, m)
    }

    /// As [`Self::upload`] for weights `m` converted from `original` (`convert`): the expert
    /// stacks keep `original`'s FP8 form where it has one.
    pub fn upload_converted(
        s: &Arc<CudaStream>,
        c: &ModelConfig,
        m: &MoeWeights,
        original: &MoeWeights,
    ) -> Result<Self> {
        check_shared_expert(c)?;
        // Each expert's matrices, the shared expert last: the stacks' groups.
        fn gate_ups(w: &MoeWeights) -> Vec<Vec<&Matrix>> {
            let experts = w.experts.iter().chain([&w.shared_expert]);
            experts.map(|e| vec![&e.gate, &e.up]).collect()
        }
        fn downs(w: &MoeWeights) -> Vec<Vec<&Matrix>> {
            let experts = w.experts.iter().chain([&w.shared_expert]);
            experts.map(|e| vec![&e.down]).collect()
        }
        Ok(DeviceMoe {
            router: DeviceMatrices::concat(s, &[&m.router, &m.shared_expert_gate])?,
            gate_up: DeviceMatrices::stack_of_concats(s, &gate_ups(m))?
                .with_fp8(s, &gate_ups(original))?,
            down: DeviceMatrices::stack_of_concats(s, &downs(m))?.with_fp8(s, &downs(original))?,
        })
    }
}

pub struct DeviceLayer {
    pub input_norm: CudaSlice<f32>,
    pub post_norm: CudaSlice<f32>,
    pub mixer: DeviceMixer,
    pub moe: DeviceMoe,
}

impl DeviceLayer {
    /// Copies one layer to the device; `o` is the layer before conversion (`convert`), whose
    /// FP8 forms the products keep for prefill.
    fn upload(
        s: &Arc<CudaStream>,
        c: &ModelConfig,
        l: &LayerWeights,
        o: &LayerWeights,
    ) -> Result<Self> {
        let mixer = match (&l.mixer, &o.mixer) {
            (Mixer::DeltaNet(d), Mixer::DeltaNet(od)) => DeviceMixer::DeltaNet {
                // GDN's b and a projections (32 rows) are no whole FP8 blocks: in_proj keeps
                // no FP8 form (DeviceFp8::stack_of_concats would find none).
                in_proj: DeviceMatrices::concat(
                    s,
                    &[&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_b, &d.in_proj_a],
                )?,
                out_proj: DeviceMatrices::concat(s, &[&d.out_proj])?
                    .with_fp8(s, &[vec![&od.out_proj]])?,
                conv_w: htod(s, &d.conv1d)?,
                a_log: htod(s, &d.a_log)?,
                dt_bias: htod(s, &d.dt_bias)?,
                norm: htod(s, &d.norm)?,
            },
            (Mixer::Attention(a), Mixer::Attention(oa)) => DeviceMixer::Attention {
                qkv: DeviceMatrices::concat(s, &[&a.q_proj, &a.k_proj, &a.v_proj])?
                    .with_fp8(s, &[vec![&oa.q_proj, &oa.k_proj, &oa.v_proj]])?,
                o_proj: DeviceMatrices::concat(s, &[&a.o_proj])?
                    .with_fp8(s, &[vec![&oa.o_proj]])?,
                q_norm: htod(s, &a.q_norm)?,
                k_norm: htod(s, &a.k_norm)?,
            },
            _ => unreachable!("conversion keeps each layer's kind"),
        };
        Ok(DeviceLayer {
            input_norm: htod(s, &l.input_norm)?,
            post_norm: htod(s, &l.post_attention_norm)?,
            mixer,
            moe: DeviceMoe::upload_converted(s, c, &l.moe, &o.moe)?,
        })
    }
}

/// The MTP head (MODEL.md §4.1) on the device. `fc` is kept as its two column halves, so that
/// `u = fc_embedding · e + fc_hidden · h` is two products of rows as the kernels take them
/// (no concatenated input to build).
pub struct DeviceMtp {
    pub embedding_norm: CudaSlice<f32>,
    pub hidden_norm: CudaSlice<f32>,
    pub fc_embedding: DeviceMatrices,
    pub fc_hidden: DeviceMatrices,
    /// A full-attention layer: its KV cache is the attention layers' last (CudaBackend).
    pub layer: DeviceLayer,
    pub norm: CudaSlice<f32>,
}

impl DeviceMtp {
    fn upload(
        s: &Arc<CudaStream>,
        c: &ModelConfig,
        m: &MtpWeights,
        original: &MtpWeights,
    ) -> Result<Self> {
        let h = c.hidden_size;
        let half = |start| {
            m.fc.columns(start, h).ok_or_else(|| {
                CudaError::Shape(format!(
                    "the MTP head's fc ({}) cannot be cut into its halves",
                    m.fc.format.name()
                ))
            })
        };
        let (embedding, hidden) = (half(0)?, half(h)?);
        Ok(DeviceMtp {
            embedding_norm: htod(s, &m.embedding_norm)?,
            hidden_norm: htod(s, &m.hidden_norm)?,
            fc_embedding: DeviceMatrices::concat(s, &[&embedding])?,
            fc_hidden: DeviceMatrices::concat(s, &[&hidden])?,
            layer: DeviceLayer::upload(s, c, &m.layer, &original.layer)?,
            norm: htod(s, &m.norm)?,
        })
    }
}

pub struct CudaModel {
    pub config: ModelConfig,
    pub embed: DeviceMatrices,
    pub lm_head: DeviceMatrices,
    pub final_norm: CudaSlice<f32>,
    pub layers: Vec<DeviceLayer>,
    /// The MTP head, where the checkpoint has one: what drafting needs.
    pub mtp: Option<DeviceMtp>,
}

impl CudaModel {
    /// Copies canonical weights to the device: bf16 and MLX affine matrices as they are, GGUF
    /// blocks and FP8 tiles (or matrices stored together in different formats) converted to
    /// affine Q8 first (see [`crate::model::convert`]; the conversion error is logged). FP8
    /// matrices are kept as they ship too, for prefill ([`DeviceMatrices::fp8`]).
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
        let layers = w
            .layers
            .iter()
            .zip(&original.layers)
            .map(|(l, o)| DeviceLayer::upload(s, &w.config, l, o))
            .collect::<Result<Vec<_>>>()?;
        let mtp = match (&w.mtp, &original.mtp) {
            (Some(m), Some(o)) => Some(DeviceMtp::upload(s, &w.config, m, o)?),
            _ => None,
        };
        let model = CudaModel {
            config: w.config.clone(),
            embed: DeviceMatrices::concat(s, &[&w.embed])?,
            lm_head: DeviceMatrices::concat(s, &[&w.lm_head])?,
            final_norm: htod(s, &w.final_norm)?,
            layers,
            mtp,
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

    /// As an FP8 checkpoint runs: the synthetic model at 8 bits, its experts, attention and GDN
    /// out_proj matrices with FP8 forms of their own random values for prefill (for speed only:
    /// prefill and decode then use different weights).
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
        // A matrix as `bits` asks, and with `fp8` an FP8 form of its own random values.
        let matrices = |count: usize, rows: usize, cols: usize, seed: u64| {
            let mut m = k.matrices(bits, count, rows, cols, seed)?;
            if fp8 && super::weights::fp8_prefill() {
                m.fp8 = Some(k.fp8_matrices(count, rows, cols, seed ^ 0xF8F8)?);
            }
            Ok::<_, CudaError>(m)
        };
        // One layer of `kind`, random.
        let mut layer = |kind: LayerKind| {
            let mixer = match kind {
                LayerKind::LinearAttention => {
                    let rows = c.linear_in_proj_rows();
                    DeviceMixer::DeltaNet {
                        // No FP8 form for in_proj, as a real checkpoint's (its b and a are 32 rows).
                        in_proj: k.matrices(bits, 1, rows, h, next())?,
                        out_proj: matrices(1, h, c.linear_value_dim(), next())?,
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
                        qkv: matrices(1, rows, h, next())?,
                        o_proj: matrices(1, h, c.num_attention_heads * c.head_dim, next())?,
                        q_norm: ones(c.head_dim)?,
                        k_norm: ones(c.head_dim)?,
                    }
                }
            };
            check_shared_expert(c)?;
            let (e, inter) = (c.num_experts + 1, c.moe_intermediate_size);
            let moe = DeviceMoe {
                router: k.matrices(small_bits, 1, e, h, next())?,
                gate_up: matrices(e, 2 * inter, h, next())?,
                down: matrices(e, h, inter, next())?,
            };
            Ok::<_, CudaError>(DeviceLayer {
                input_norm: ones(h)?,
                post_norm: ones(h)?,
                mixer,
                moe,
            })
        };
        let layers = (0..c.num_hidden_layers)
            .map(|i| layer(c.layer_types[i]))
            .collect::<Result<Vec<_>>>()?;
        // The MTP head as the config says (random: its drafts are as good as random tokens).
        let mtp = if c.mtp_num_hidden_layers > 0 {
            let layer = layer(LayerKind::FullAttention)?;
            Some(DeviceMtp {
                embedding_norm: ones(h)?,
                hidden_norm: ones(h)?,
                fc_embedding: k.matrices(bits, 1, h, h, next())?,
                fc_hidden: k.matrices(bits, 1, h, h, next())?,
                layer,
                norm: ones(h)?,
            })
        } else {
            None
        };
        ensure!(
            !c.tie_word_embeddings,
            "synthetic models have an untied LM head"
        );
        let model = CudaModel {
            embed: k.matrices(bits, 1, c.vocab_size, h, next())?,
            lm_head: k.matrices(bits, 1, c.vocab_size, h, next())?,
            final_norm: ones(h)?,
            layers,
            mtp,
            config,
        };
        weights_ready(s)?;
        Ok(model)
    }

    /// Bytes of weights on the device.
    pub fn bytes(&self) -> usize {
        let head = self.mtp.iter();
        let fc = head
            .clone()
            .map(|h| h.fc_embedding.bytes() + h.fc_hidden.bytes());
        let layers = self.layers.iter().chain(head.map(|h| &h.layer));
        let mats = layers.map(|l| {
            let mixer = match &l.mixer {
                DeviceMixer::DeltaNet {
                    in_proj, out_proj, ..
                } => in_proj.bytes() + out_proj.bytes(),
                DeviceMixer::Attention { qkv, o_proj, .. } => qkv.bytes() + o_proj.bytes(),
            };
            let m = &l.moe;
            mixer + m.router.bytes() + m.gate_up.bytes() + m.down.bytes()
        });
        self.embed.bytes() + self.lm_head.bytes() + mats.sum::<usize>() + fc.sum::<usize>()
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
