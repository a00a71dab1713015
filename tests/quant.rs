//! Affine quantisation (src/quant.rs): bit-exact agreement with MLX's quantiser on hand-made
//! groups, packing order, and per-group error bounds of the quantise → dequantise round trip.

use lily::checkpoint::tensor::DType;
use lily::quant::{self, Affine, QuantError};

/// MLX's output for one input case: `mx.quantize(bf16 values [1, 128], group_size, bits)` with
/// mlx 0.32.4 on the CPU (tools/check_mlx.py checks whole models the same way). Scales and
/// biases are bf16 bit patterns.
struct Golden {
    case: u32,
    bits: u32,
    group_size: usize,
    words: &'static [u32],
    scales: &'static [u16],
    biases: &'static [u16],
}

/// 128 bf16-exact inputs per case, each chosen to pin one rule of the quantiser:
/// 0: integers × 2⁻⁹ with |min| = |max| (the edge is then the maximum, the scale negative);
/// 1: pseudo-random bf16 bit patterns of both signs (generic rounding);
/// 2: all negative (the minimum is the edge; MLX's GPU kernels would clamp the maximum to 0);
/// 3: a constant group and an all-zero group (both must round-trip exactly);
/// 4: halves on a grid that lands exactly between codes (ties round to even, not away from 0).
fn case(k: u32) -> Vec<f32> {
    (0..128u32)
        .map(|i| match k {
            0 => (((i * 37 + 11) % 61) as f32 - 30.0) * 2f32.powi(-9),
            1 => {
                let h = (i * 7919 + 104_729) % 65_536;
                let bits = (0x3b00 + (h % 0x300)) | ((h & 1) << 15);
                f32::from_bits(bits << 16)
            }
            2 => -((1 + i % 13) as f32) * 2f32.powi(-8),
            3 => {
                if i < 64 {
                    0.25
                } else {
                    0.0
                }
            }
            _ => ((i * 7) % 31) as f32 * 0.5 * 2f32.powi(-6),
        })
        .collect()
}

const GOLDEN: &[Golden] = &[
    Golden {
        case: 0,
        bits: 4,
        group_size: 64,
        words: &[
            0x93d6fa3d, 0xb5f92c6f, 0xe71b5e82, 0x0a3d71a4, 0x2c6f93d6, 0x5f82c5f9, 0x71b4e81b,
            0xa3d70a4e, 0xc6f93d6f, 0xe82b5f92, 0x1a4e71b5, 0x3d60a3d7, 0x5f92c6f9, 0x81b5f82c,
            0xa4e71b4e, 0xd6fa3d70,
        ],
        scales: &[0xbbf0, 0xbbf0],
        biases: &[0x3d70, 0x3d70],
    },
    Golden {
        case: 0,
        bits: 8,
        group_size: 64,
        words: &[
            0xff9a33d1, 0x912bc962, 0x22c05af7, 0xb751ef89, 0x49e6801a, 0xde7711af, 0x6f09a640,
            0x009e37d5, 0x952fcd66, 0x26c45efc, 0xbc55f38d, 0x4deb841e, 0xe27c15b3, 0x730dab44,
            0x04a23cda, 0x9a33d16b, 0x2bc962ff, 0xc05af791, 0x51ef8922, 0xe6801ab7, 0x7711af49,
            0x09a640de, 0x9e37d56f, 0x2fcd6600, 0xc45efc95, 0x55f38d26, 0xeb841ebc, 0x7c15b34d,
            0x0dab44e2, 0xa23cda73, 0x33d16b04, 0xc962ff9a,
        ],
        scales: &[0xb9f0, 0xb9f0],
        biases: &[0x3d70, 0x3d70],
    },
    Golden {
        case: 0,
        bits: 4,
        group_size: 32,
        words: &[
            0x93d6fa3d, 0xb5f92c6f, 0xe71b5e82, 0x0a3d71a4, 0x2c6f93d6, 0x5f82c5f9, 0x71b4e81b,
            0xa3d70a4e, 0xc6f93d6f, 0xe82b5f92, 0x1a4e71b5, 0x3d60a3d7, 0xb17e4a07, 0x8f5b18e4,
            0x6c29f5c2, 0x3a06d39f,
        ],
        scales: &[0xbbf0, 0xbbe8, 0xbbf0, 0x3bf0],
        biases: &[0x3d70, 0x3d68, 0x3d70, 0xbd70],
    },
    Golden {
        case: 1,
        bits: 4,
        group_size: 64,
        words: &[
            0x2a8f0a78, 0x8b788c78, 0x8e688f69, 0x785b7849, 0x782e680a, 0x6988598c, 0x49882a8f,
            0x0a698b78, 0x84c782a8, 0x81f698b7, 0x978498e6, 0xa680a785, 0xb598c782, 0xe2a8f698,
            0x98b78498, 0x98e680a7,
        ],
        scales: &[0xbc6a, 0x3c7f],
        biases: &[0x3dea, 0xbdff],
    },
    Golden {
        case: 1,
        bits: 8,
        group_size: 64,
        words: &[
            0x02a27783, 0x279879f5, 0x7cc16e85, 0x7daf7384, 0x79fe5e89, 0x7bd96787, 0x72843e92,
            0x778351b4, 0x658701a2, 0x6e8526e3, 0x4c8e7cc2, 0x5e8a7d83, 0x1c9b79ff, 0x3e927b86,
            0x7db47284, 0x00a25a8b, 0x85249979, 0x8443c26d, 0x8a7db073, 0x870afe5d, 0x937bdc67,
            0x8d72843d, 0xa4768350, 0x99658701, 0xc36d8523, 0xb14b8e7c, 0xff5c8a7d, 0xdd1a9c79,
            0x843c937b, 0x8b7db572, 0x8700a476, 0x957ae664,
        ],
        scales: &[0xba6a, 0x3a7f],
        biases: &[0x3dea, 0xbdff],
    },
    Golden {
        case: 1,
        bits: 4,
        group_size: 32,
        words: &[
            0xe681f698, 0x85988498, 0x82a880a7, 0x98b598c7, 0x782e680a, 0x6988598c, 0x49882a8f,
            0x0a698b78, 0x84c782a8, 0x81f698b7, 0x978498e6, 0xa680a785, 0xb598c782, 0xe2a8f698,
            0x98b78498, 0x98e680a7,
        ],
        scales: &[0x3c67, 0xbc6a, 0x3c7d, 0x3c7f],
        biases: &[0xbde7, 0x3dea, 0xbdfd, 0xbdff],
    },
    Golden {
        case: 2,
        bits: 4,
        group_size: 64,
        words: &[
            0x679abcef, 0xcef01245, 0x245679ab, 0x9abcef01, 0xf0124567, 0x5679abce, 0xbcef0124,
            0x1245679a, 0x79abcef0, 0xef012456, 0x45679abc, 0xabcef012, 0x01245679, 0x679abcef,
            0xcef01245, 0x245679ab,
        ],
        scales: &[0x3b50, 0x3b50],
        biases: &[0xbd50, 0xbd50],
    },
    Golden {
        case: 2,
        bits: 8,
        group_size: 64,
        words: &[
            0xbfd4eaff, 0x6a7f95aa, 0x152a4055, 0xd4eaff00, 0x7f95aabf, 0x2a40556a, 0xeaff0015,
            0x95aabfd4, 0x40556a7f, 0xff00152a, 0xaabfd4ea, 0x556a7f95, 0x00152a40, 0xbfd4eaff,
            0x6a7f95aa, 0x152a4055, 0xd4eaff00, 0x7f95aabf, 0x2a40556a, 0xeaff0015, 0x95aabfd4,
            0x40556a7f, 0xff00152a, 0xaabfd4ea, 0x556a7f95, 0x00152a40, 0xbfd4eaff, 0x6a7f95aa,
            0x152a4055, 0xd4eaff00, 0x7f95aabf, 0x2a40556a,
        ],
        scales: &[0x3941, 0x3941],
        biases: &[0xbd50, 0xbd50],
    },
    Golden {
        case: 2,
        bits: 4,
        group_size: 32,
        words: &[
            0x679abcef, 0xcef01245, 0x245679ab, 0x9abcef01, 0xf0124567, 0x5679abce, 0xbcef0124,
            0x1245679a, 0x79abcef0, 0xef012456, 0x45679abc, 0xabcef012, 0x01245679, 0x679abcef,
            0xcef01245, 0x245679ab,
        ],
        scales: &[0x3b50, 0x3b50, 0x3b50, 0x3b50],
        biases: &[0xbd50, 0xbd50, 0xbd50, 0xbd50],
    },
    Golden {
        case: 3,
        bits: 4,
        group_size: 64,
        words: &[
            0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
            0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
            0x00000000, 0x00000000,
        ],
        scales: &[0xb3d7, 0xb3d7],
        biases: &[0x3e80, 0x0000],
    },
    Golden {
        case: 3,
        bits: 8,
        group_size: 64,
        words: &[
            0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
            0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
            0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
            0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
            0x00000000, 0x00000000, 0x00000000, 0x00000000,
        ],
        scales: &[0xb3d7, 0xb3d7],
        biases: &[0x3e80, 0x0000],
    },
    Golden {
        case: 3,
        bits: 4,
        group_size: 32,
        words: &[
            0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
            0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
            0x00000000, 0x00000000,
        ],
        scales: &[0xb3d7, 0xb3d7, 0xb3d7, 0xb3d7],
        biases: &[0x3e80, 0x3e80, 0x0000, 0x0000],
    },
    Golden {
        case: 4,
        bits: 4,
        group_size: 64,
        words: &[
            0x6ad148cf, 0x9c048be2, 0xc047ae26, 0xf36ae258, 0x26ad148c, 0x69c048be, 0x8c047ae2,
            0xcf36ae25, 0xe26ad148, 0x269c048b, 0x58c047ae, 0x8cf36ae2, 0xbe26ad14, 0xe269c048,
            0x258c047a, 0x48cf36ae,
        ],
        scales: &[0xbc80, 0xbc80],
        biases: &[0x3e70, 0x3e70],
    },
    Golden {
        case: 4,
        bits: 8,
        group_size: 64,
        words: &[
            0x4c88c4ff, 0x66a2dd11, 0x80bbf62a, 0x99d40844, 0xb2ee225e, 0xcc003c77, 0xe61a5590,
            0xff336eaa, 0x114c88c4, 0x2a66a2dd, 0x4480bbf6, 0x5e99d408, 0x77b2ee22, 0x90cc003c,
            0xaae61a55, 0xc4ff336e, 0xdd114c88, 0xf62a66a2, 0x084480bb, 0x225e99d4, 0x3c77b2ee,
            0x5590cc00, 0x6eaae61a, 0x88c4ff33, 0xa2dd114c, 0xbbf62a66, 0xd4084480, 0xee225e99,
            0x003c77b2, 0x1a5590cc, 0x336eaae6, 0x4c88c4ff,
        ],
        scales: &[0xba71, 0xba71],
        biases: &[0x3e70, 0x3e70],
    },
    Golden {
        case: 4,
        bits: 4,
        group_size: 32,
        words: &[
            0x6ad148cf, 0x9c048be2, 0xc047ae26, 0xf36ae258, 0x26ad148c, 0x69c048be, 0x8c047ae2,
            0xcf36ae25, 0xe26ad148, 0x269c048b, 0x58c047ae, 0x8cf36ae2, 0xbe26ad14, 0xe269c048,
            0x258c047a, 0x48cf36ae,
        ],
        scales: &[0xbc80, 0xbc80, 0xbc80, 0xbc80],
        biases: &[0x3e70, 0x3e70, 0x3e70, 0x3e70],
    },
];

fn bf16_bits(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

#[test]
fn quantiser_matches_mlx_bit_for_bit() {
    for g in GOLDEN {
        let q = Affine::new(g.bits, g.group_size).unwrap();
        let out = quant::quantize(&case(g.case), 128, q, DType::BF16).unwrap();
        let words: Vec<u32> = out
            .packed
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let what = format!("case {} at {} bits, group {}", g.case, g.bits, g.group_size);
        assert_eq!(words, g.words, "{what}: packed words");
        assert_eq!(bf16_bits(&out.scales), g.scales, "{what}: scales");
        assert_eq!(bf16_bits(&out.biases), g.biases, "{what}: biases");
    }
}

#[test]
fn codes_pack_lowest_bits_first() {
    let mut w = [0u32; 1];
    quant::pack(&[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut w);
    assert_eq!(w[0], 0x8765_4321);
    quant::pack(&[0x11, 0x22, 0x33, 0x44], 8, &mut w);
    assert_eq!(w[0], 0x4433_2211);
    quant::pack(&[1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3], 2, &mut w);
    assert_eq!(w[0], 0xc000_0039);
}

#[test]
fn pack_and_unpack_are_inverse() {
    let mut rng = Rng(7);
    for bits in quant::SUPPORTED_BITS {
        let codes: Vec<u8> = (0..256).map(|_| (rng.next() % (1 << bits)) as u8).collect();
        let mut words = vec![0u32; 256 * bits as usize / 32];
        quant::pack(&codes, bits, &mut words);
        let mut back = vec![0u8; 256];
        quant::unpack(&words, bits, &mut back);
        assert_eq!(back, codes, "{bits} bits");
    }
}

/// Every value comes back within half a step of its group (plus what rounding the scale and
/// bias to the storage dtype adds), except values clamped at the top code, which the edge rule
/// may push up to one step away. The group's edge (its larger-magnitude extreme) comes back
/// exactly when scales are stored in f32.
#[test]
fn round_trip_error_is_bounded_per_group() {
    let mut rng = Rng(42);
    for bits in quant::SUPPORTED_BITS {
        for group_size in [16usize, 32, 64, 128] {
            for dtype in [DType::F32, DType::BF16] {
                let cols = 256;
                let rows = 24;
                // Rows of very different magnitudes, some with an outlier, some one-signed.
                let values: Vec<f32> = (0..rows * cols)
                    .map(|i| {
                        let r = i / cols;
                        let v = rng.normal() * 10f32.powi(r as i32 % 6 - 4);
                        let v = if r % 5 == 1 && i % 97 == 0 {
                            v * 30.0
                        } else {
                            v
                        };
                        let v = if r % 7 == 3 {
                            v.abs()
                        } else if r % 7 == 4 {
                            -v.abs()
                        } else {
                            v
                        };
                        quant::round_to(v, dtype)
                    })
                    .collect();
                let q = Affine::new(bits, group_size).unwrap();
                let out = quant::quantize(&values, cols, q, dtype).unwrap();
                check_bounds(&values, cols, q, dtype, &out);
            }
        }
    }
}

fn check_bounds(values: &[f32], cols: usize, q: Affine, dtype: DType, out: &quant::Quantized) {
    let rel = match dtype {
        DType::BF16 => 2f32.powi(-8),
        _ => 0.0,
    };
    let n_bins = q.max_code() as f32;
    let groups = q.groups_per_row(cols);
    let mut back = vec![0f32; cols];
    let mut codes = vec![0u8; cols];
    for (r, row) in values.chunks_exact(cols).enumerate() {
        let packed =
            &out.packed[r * q.words_per_row(cols) * 4..(r + 1) * q.words_per_row(cols) * 4];
        let ss = dtype.size();
        let scales = &out.scales[r * groups * ss..(r + 1) * groups * ss];
        let biases = &out.biases[r * groups * ss..(r + 1) * groups * ss];
        quant::dequantize_row(
            packed,
            scales,
            biases,
            dtype,
            q.bits,
            q.group_size,
            &mut back,
        );
        let words: Vec<u32> = packed
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        quant::unpack(&words, q.bits, &mut codes);
        for g in 0..groups {
            let s = quant::read_scalar(scales, dtype, g).abs();
            let b = quant::read_scalar(biases, dtype, g);
            let range = g * q.group_size..(g + 1) * q.group_size;
            let slack = rel * (s * n_bins + b.abs()) + 8.0 * f32::EPSILON * (s * n_bins + b.abs());
            for c in range.clone() {
                let err = (back[c] - row[c]).abs();
                let steps = if codes[c] as f32 == n_bins { 1.0 } else { 0.5 };
                assert!(
                    err <= steps * s + slack,
                    "{} bits, group {}, {dtype:?}: row {r} col {c}: {} came back as {} (scale {s}, bias {b})",
                    q.bits, q.group_size, row[c], back[c]
                );
            }
            let group = &row[range];
            let (lo, hi) = group
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                    (lo.min(v), hi.max(v))
                });
            let edge = if lo.abs() > hi.abs() { lo } else { hi };
            if dtype == DType::F32 && (hi - lo) / n_bins > 1e-7 {
                assert_eq!(
                    b, edge,
                    "row {r} group {g}: the bias is the group's edge value"
                );
            }
        }
    }
}

#[test]
fn constant_and_zero_groups_round_trip_exactly() {
    for bits in quant::SUPPORTED_BITS {
        let q = Affine::new(bits, 64).unwrap();
        let values: Vec<f32> = (0..256)
            .map(|i| match i / 64 {
                0 => 0.0,
                1 => -3.5,
                2 => 1e-3,
                _ => 0.0,
            })
            .collect();
        let values: Vec<f32> = values
            .into_iter()
            .map(|v| quant::round_to(v, DType::BF16))
            .collect();
        let out = quant::quantize(&values, 256, q, DType::BF16).unwrap();
        let mut back = vec![0f32; 256];
        quant::dequantize_row(
            &out.packed,
            &out.scales,
            &out.biases,
            DType::BF16,
            bits,
            64,
            &mut back,
        );
        assert_eq!(back, values, "{bits} bits");
    }
}

#[test]
fn invalid_parameters_are_errors() {
    assert_eq!(Affine::new(3, 64), Err(QuantError::Bits { bits: 3 }));
    assert_eq!(
        Affine::new(4, 12),
        Err(QuantError::GroupSize {
            group_size: 12,
            bits: 4,
            per_word: 8
        })
    );
    assert_eq!(
        Affine::new(8, 0),
        Err(QuantError::GroupSize {
            group_size: 0,
            bits: 8,
            per_word: 4
        })
    );
    let q = Affine::new(4, 64).unwrap();
    assert_eq!(
        quant::quantize(&[0.0; 96], 96, q, DType::BF16),
        Err(QuantError::Columns {
            group_size: 64,
            cols: 96
        })
    );
    // Any group size dividing the columns works, not only MLX's 32, 64 and 128.
    assert!(quant::quantize(&[0.5; 96], 96, Affine::new(4, 24).unwrap(), DType::BF16).is_ok());
}

/// xorshift64*: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        (-2.0 * self.unit().ln()).sqrt() * (std::f32::consts::TAU * self.unit()).cos()
    }
}

/// `dequantize_row` is `s·q + b` in f32 for every element (its word-at-a-time paths for 4 and 8
/// bits included), with q the unpacked code and s, b its group's scale and bias.
#[test]
fn dequantize_row_is_scale_times_code_plus_bias() {
    let mut rng = Rng(11);
    for bits in quant::SUPPORTED_BITS {
        for group in [32usize, 64, 128] {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                let cols = 4 * group;
                let words = cols * bits as usize / 32;
                let packed: Vec<u8> = (0..4 * words).map(|_| rng.next() as u8).collect();
                let groups = cols / group;
                let scalars = |rng: &mut Rng| -> Vec<u8> {
                    (0..groups)
                        .flat_map(|_| {
                            let v = rng.normal() * 0.1;
                            match dtype {
                                DType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                                DType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                                _ => v.to_le_bytes().to_vec(),
                            }
                        })
                        .collect()
                };
                let (scales, biases) = (scalars(&mut rng), scalars(&mut rng));
                let mut got = vec![0f32; cols];
                quant::dequantize_row(&packed, &scales, &biases, dtype, bits, group, &mut got);
                let mut codes = vec![0u8; cols];
                let packed_words: Vec<u32> = packed
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                quant::unpack(&packed_words, bits, &mut codes);
                for (c, (&g, &q)) in got.iter().zip(&codes).enumerate() {
                    let s = quant::read_scalar(&scales, dtype, c / group);
                    let b = quant::read_scalar(&biases, dtype, c / group);
                    let want = s * q as f32 + b;
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{bits} bits, group {group}, {dtype:?}: element {c}"
                    );
                }
            }
        }
    }
}
