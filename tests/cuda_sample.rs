//! The device sampler (src/cuda/sample.cu) against the CPU reference
//! ([`DeviceSampling::distribution`], the sampler the CPU backend uses) on fresh random logits at
//! the model's vocabulary size.
//!
//! They need an H200 (or another sm_90a GPU) and FAIL without one; scripts/gpu-check.sh runs them.
//! Inputs are random with a fresh seed per run (printed; set LILY_TEST_SEED to repeat a run).
//!
//! Exactness: both samplers compute each token's weight from the same f32 operations and sum in
//! f64, in different orders, so their cumulative probabilities differ by ~1e-15. The device's
//! token must therefore equal the CPU's draw for the same `u` except when `u` lies within
//! [`BOUNDARY`] of a boundary of the CPU's cumulative distribution (then either neighbour is
//! right). Wrong filtering or a wrong order moves whole candidates, which is far larger.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use lily::cuda::sample::{RowDraw, SampleKernels};
use lily::cuda::CudaDevice;
use lily::sampling::{draw, DeviceSampling};

/// The real model's vocabulary (logits per row).
const VOCAB: usize = 248_320;
/// A draw this close to a CDF boundary may go either way between the two samplers.
const BOUNDARY: f64 = 1e-9;

fn device() -> CudaDevice {
    CudaDevice::open("cuda").unwrap_or_else(|e| panic!("these tests need a GPU: {e}"))
}

/// Logits shaped like a language model's: a wide normal bulk, a few strong candidates, runs of
/// exactly tied values (bf16 makes many ties by itself), and a few NaN / -inf / +inf entries.
fn logits(rng: &mut Rng) -> Vec<bf16> {
    let spread = 1.5 + 2.5 * rng.uniform();
    let mut l: Vec<f32> = (0..VOCAB).map(|_| (rng.normal() * spread) as f32).collect();
    for _ in 0..1 + rng.below(30) {
        let t = rng.below(VOCAB);
        l[t] = (8.0 + 10.0 * rng.uniform()) as f32;
    }
    for _ in 0..20 {
        let (from, to) = (rng.below(VOCAB), rng.below(VOCAB));
        l[to] = l[from];
    }
    for special in [f32::NAN, f32::NEG_INFINITY, f32::INFINITY] {
        if rng.below(4) == 0 {
            l[rng.below(VOCAB)] = special;
        }
    }
    l.into_iter().map(bf16::from_f32).collect()
}

/// A penalty history: distinct tokens, some only in the prompt (count 0).
fn history(rng: &mut Rng, len: usize) -> Vec<(u32, u32)> {
    let mut tokens: Vec<u32> = (0..len).map(|_| rng.below(VOCAB) as u32).collect();
    tokens.sort_unstable();
    tokens.dedup();
    tokens
        .into_iter()
        .map(|t| (t, rng.below(4) as u32))
        .collect()
}

fn random_sampling(rng: &mut Rng) -> DeviceSampling {
    let penalties = rng.below(3);
    DeviceSampling {
        temperature: rng.pick(&[0.0, 0.3, 0.7, 1.0, 1.6]),
        top_k: rng.pick(&[
            None,
            None,
            Some(1),
            Some(20),
            Some(64),
            Some(1000),
            Some(VOCAB),
        ]),
        top_p: rng.pick(&[1.0, 1.0, 0.95, 0.8, 0.5, 0.05]),
        min_p: rng.pick(&[0.0, 0.0, 0.05, 0.3]),
        repetition_penalty: if penalties == 1 {
            rng.pick(&[0.8, 1.3])
        } else {
            1.0
        },
        frequency_penalty: if penalties == 2 { 0.5 } else { 0.0 },
        presence_penalty: if penalties == 2 {
            rng.pick(&[-1.0, 0.7])
        } else {
            0.0
        },
        vocab_limit: rng.pick(&[VOCAB, VOCAB - 243]),
        history: if penalties > 0 {
            let len = 1 + rng.below(3000);
            history(rng, len)
        } else {
            Vec::new()
        },
    }
}

struct Sampler {
    stream: Arc<CudaStream>,
    kernels: SampleKernels,
    out: CudaSlice<i32>,
    logits: CudaSlice<bf16>,
}

impl Sampler {
    fn new(dev: &CudaDevice) -> Self {
        let stream = dev.stream().clone();
        Sampler {
            kernels: SampleKernels::load(dev, 1).expect("loading the sample kernels"),
            out: stream.alloc_zeros(1).expect("alloc"),
            logits: stream.alloc_zeros(VOCAB).expect("alloc"),
            stream,
        }
    }
    fn set_logits(&mut self, logits: &[bf16]) {
        self.stream
            .memcpy_htod(logits, &mut self.logits)
            .expect("host to device copy");
    }
    fn sample(&mut self, sampling: &DeviceSampling, u: f64) -> i32 {
        // Poisoned, so a launch that writes nothing shows.
        self.stream
            .memcpy_htod(&[i32::MIN], &mut self.out)
            .expect("host to device copy");
        self.kernels
            .sample(
                &self.logits.as_view(),
                sampling,
                u,
                &mut self.out.as_view_mut(),
            )
            .expect("sample");
        self.stream.clone_dtoh(&self.out).expect("device to host")[0]
    }
}

/// Where each candidate's interval of the CPU's cumulative distribution starts and ends.
fn intervals(dist: &[(u32, f64)]) -> Vec<(u32, f64, f64)> {
    let mut acc = 0.0;
    dist.iter()
        .map(|&(t, p)| {
            let start = acc;
            acc += p;
            (t, start, acc)
        })
        .collect()
}

/// The device's token for `u` is the CPU's, up to draws within BOUNDARY of a CDF boundary.
fn check_draw(got: i32, dist: &[(u32, f64)], cdf: &[(u32, f64, f64)], u: f64, what: &str) {
    let want = draw(dist, u);
    if got == want as i32 {
        return;
    }
    let near_boundary = cdf
        .iter()
        .any(|&(_, start, end)| (u - start).abs() < BOUNDARY || (u - end).abs() < BOUNDARY);
    let got_is_neighbour = cdf
        .iter()
        .any(|&(t, start, end)| t as i32 == got && u >= start - BOUNDARY && u < end + BOUNDARY);
    assert!(
        near_boundary && got_is_neighbour,
        "{what}: u = {u}: device picked {got}, the CPU {want} ({} candidates)",
        dist.len()
    );
}

#[test]
fn device_draws_equal_the_cpu_reference() {
    let dev = device();
    let mut rng = Rng::new("device_draws_equal_the_cpu_reference");
    let mut sampler = Sampler::new(&dev);
    let (mut draws, mut cases) = (0, 0);
    for case in 0..12 {
        let bf = logits(&mut rng);
        let logits: Vec<f32> = bf.iter().map(|x| x.to_f32()).collect();
        sampler.set_logits(&bf);
        for _ in 0..8 {
            let sampling = random_sampling(&mut rng);
            let what = format!(
                "case {case}: T {} top-k {:?} top-p {} min-p {} penalties {} {} {} ({} tokens) limit {}",
                sampling.temperature,
                sampling.top_k,
                sampling.top_p,
                sampling.min_p,
                sampling.repetition_penalty,
                sampling.frequency_penalty,
                sampling.presence_penalty,
                sampling.history.len(),
                sampling.vocab_limit
            );
            let dist = sampling.distribution(&logits).expect("the CPU reference");
            let cdf = intervals(&dist);
            // Random draws, the middle of random candidates' intervals (each candidate must be
            // reachable where the CPU puts it), and the ends of the range.
            let mut us: Vec<f64> = (0..10).map(|_| rng.uniform()).collect();
            for _ in 0..10 {
                let (_, start, end) = cdf[rng.below(cdf.len())];
                // (The CPU's sums may round the last interval's middle up to 1.)
                us.push(((start + end) / 2.0).min(1.0 - f64::EPSILON));
            }
            us.extend([0.0, 1.0 - f64::EPSILON]);
            for u in us {
                let got = sampler.sample(&sampling, u);
                check_draw(got, &dist, &cdf, u, &what);
                draws += 1;
            }
            cases += 1;
        }
    }
    println!("{cases} parameter sets, {draws} draws agree");
}

/// Several rows drawn in one set of launches (`sample_rows`, as a pass's sampled rows are): each
/// row's token is the one `sample` draws for it alone and agrees with the CPU reference; rows not
/// drawn keep what they held. The rows' parameters differ (greedy with penalties, temperature
/// only, top-k, top-p, min-p, histories of different lengths), and the drawn rows are not the
/// first ones nor in order.
#[test]
fn batched_draws_equal_single_draws() {
    let dev = device();
    let mut rng = Rng::new("batched_draws_equal_single_draws");
    let stream = dev.stream().clone();
    let mut kernels = SampleKernels::load(&dev, 1).expect("loading the sample kernels");
    let mut single = Sampler::new(&dev);
    const ROWS: usize = 7;
    for round in 0..6 {
        let rows: Vec<Vec<bf16>> = (0..ROWS).map(|_| logits(&mut rng)).collect();
        let all: Vec<bf16> = rows.concat();
        let dl = stream.clone_htod(&all).expect("alloc");
        let mut samplings: Vec<DeviceSampling> =
            (0..ROWS).map(|_| random_sampling(&mut rng)).collect();
        // Round 0: every kind at least once.
        if round == 0 {
            samplings[1].temperature = 0.0;
            samplings[1].history = history(&mut rng, 50);
            samplings[1].repetition_penalty = 1.3;
            samplings[2] = DeviceSampling {
                top_k: None,
                top_p: 1.0,
                min_p: 0.0,
                temperature: 0.7,
                ..samplings[2].clone()
            };
            samplings[4].top_p = 0.9;
            samplings[4].temperature = 1.0;
        }
        let us: Vec<f64> = (0..ROWS).map(|_| rng.uniform()).collect();
        // Rows 5, 1, 2, 4, 6 drawn; 0 and 3 not.
        let drawn = [5usize, 1, 2, 4, 6];
        let draws: Vec<RowDraw> = drawn
            .iter()
            .map(|&row| RowDraw {
                row,
                sampling: &samplings[row],
                u: us[row],
            })
            .collect();
        let mut out = stream.clone_htod(&[i32::MIN; ROWS]).expect("alloc");
        kernels
            .sample_rows(&dl.as_view(), VOCAB, &draws, &mut out.as_view_mut())
            .expect("sample_rows");
        let got = stream.clone_dtoh(&out).expect("device to host");
        for row in 0..ROWS {
            let what = format!("round {round}, row {row}");
            if !drawn.contains(&row) {
                assert_eq!(got[row], i32::MIN, "{what}: not drawn, but written");
                continue;
            }
            single.set_logits(&rows[row]);
            let alone = single.sample(&samplings[row], us[row]);
            assert_eq!(got[row], alone, "{what}: batched and single draws differ");
            let logits: Vec<f32> = rows[row].iter().map(|x| x.to_f32()).collect();
            let dist = samplings[row]
                .distribution(&logits)
                .expect("the CPU reference");
            check_draw(got[row], &dist, &intervals(&dist), us[row], &what);
        }
    }
    // A row drawn twice is refused.
    let dl = stream
        .clone_htod(&vec![bf16::ZERO; 2 * VOCAB])
        .expect("alloc");
    let sampling = random_sampling(&mut rng);
    let twice = [0, 0].map(|row| RowDraw {
        row,
        sampling: &sampling,
        u: 0.5,
    });
    let mut out = stream.clone_htod(&[0i32; 2]).expect("alloc");
    assert!(kernels
        .sample_rows(&dl.as_view(), VOCAB, &twice, &mut out.as_view_mut())
        .is_err());
}

#[test]
fn draws_follow_the_cpu_distribution() {
    let dev = device();
    let mut rng = Rng::new("draws_follow_the_cpu_distribution");
    let mut sampler = Sampler::new(&dev);
    let bf = logits(&mut rng);
    let logits: Vec<f32> = bf.iter().map(|x| x.to_f32()).collect();
    sampler.set_logits(&bf);
    let cases = [
        (1.0, Some(50), 1.0, 0.0),
        (0.8, None, 0.9, 0.02),
        (1.3, Some(400), 0.97, 0.0),
    ];
    for (temperature, top_k, top_p, min_p) in cases {
        let sampling = DeviceSampling {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty: 1.2,
            frequency_penalty: 0.3,
            presence_penalty: 0.4,
            vocab_limit: VOCAB,
            history: history(&mut rng, 200),
        };
        let dist = sampling.distribution(&logits).expect("the CPU reference");
        const DRAWS: usize = 10_000;
        let mut counts = std::collections::HashMap::<u32, usize>::new();
        for _ in 0..DRAWS {
            let token = sampler.sample(&sampling, rng.uniform());
            assert!(token >= 0, "no token drawn");
            *counts.entry(token as u32).or_default() += 1;
        }
        // Pearson's chi-square, rare candidates pooled so every expected count is at least 5.
        let (mut chi2, mut bins) = (0.0, 0);
        let (mut pooled_expected, mut pooled_seen) = (0.0, 0usize);
        for &(token, p) in &dist {
            let expected = p * DRAWS as f64;
            let seen = counts.remove(&token).unwrap_or(0);
            if expected < 5.0 {
                pooled_expected += expected;
                pooled_seen += seen;
                continue;
            }
            chi2 += (seen as f64 - expected).powi(2) / expected;
            bins += 1;
        }
        if pooled_expected > 0.0 {
            chi2 += (pooled_seen as f64 - pooled_expected).powi(2) / pooled_expected.max(1e-9);
            bins += 1;
        }
        assert!(
            counts.is_empty(),
            "T {temperature} top-k {top_k:?} top-p {top_p}: the device drew tokens outside the \
             CPU's candidates: {counts:?}"
        );
        // Mean df, sd sqrt(2 df): 6 sd above is a false alarm about once in 10^9 runs.
        let df = (bins.max(2) - 1) as f64;
        let bound = df + 6.0 * (2.0 * df).sqrt();
        println!(
            "T {temperature} top-k {top_k:?} top-p {top_p} min-p {min_p}: {} candidates, \
             chi2 {chi2:.1} over {bins} bins (bound {bound:.1})",
            dist.len()
        );
        assert!(chi2 < bound, "chi-square {chi2:.1} >= {bound:.1}");
    }
}

#[test]
fn no_finite_logit_gives_no_token() {
    let dev = device();
    let mut sampler = Sampler::new(&dev);
    sampler.set_logits(&vec![bf16::NAN; VOCAB]);
    let sampling = DeviceSampling {
        temperature: 1.0,
        top_k: Some(20),
        top_p: 0.9,
        min_p: 0.0,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        vocab_limit: VOCAB,
        history: Vec::new(),
    };
    assert_eq!(sampler.sample(&sampling, 0.5), -1);
}

/// Time per draw, host round trip included (printed, never asserted).
#[test]
fn sampling_time() {
    let dev = device();
    let mut rng = Rng::new("sampling_time");
    let mut sampler = Sampler::new(&dev);
    sampler.set_logits(&logits(&mut rng));
    for (top_k, top_p) in [(None, 1.0), (Some(20), 0.95), (None, 0.95)] {
        let sampling = DeviceSampling {
            temperature: 0.7,
            top_k,
            top_p,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.5,
            vocab_limit: VOCAB,
            history: history(&mut rng, 500),
        };
        sampler.sample(&sampling, 0.5);
        const RUNS: usize = 200;
        let start = Instant::now();
        for _ in 0..RUNS {
            sampler.sample(&sampling, rng.uniform());
        }
        println!(
            "top-k {top_k:?} top-p {top_p}: {:.1} us per draw (with the copies and a sync)",
            start.elapsed().as_secs_f64() * 1e6 / RUNS as f64
        );
    }
    // A pass's 64 sampled rows: one draw at a time, as passes drew before sample_rows, and all
    // in one set of launches.
    const ROWS: usize = 64;
    let stream = dev.stream().clone();
    let all: Vec<bf16> = (0..ROWS).flat_map(|_| logits(&mut rng)).collect();
    let dl = stream.clone_htod(&all).expect("alloc");
    let mut out = stream.alloc_zeros::<i32>(ROWS).expect("alloc");
    let mut kernels = SampleKernels::load(&dev, 1).expect("loading the sample kernels");
    for (top_k, top_p) in [(None, 1.0), (Some(20), 0.95), (None, 0.95)] {
        let sampling = DeviceSampling {
            temperature: 0.7,
            top_k,
            top_p,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            vocab_limit: VOCAB,
            history: Vec::new(),
        };
        let draws: Vec<RowDraw> = (0..ROWS)
            .map(|row| RowDraw {
                row,
                sampling: &sampling,
                u: 0.5,
            })
            .collect();
        let mut time = |batched: bool| {
            const RUNS: usize = 20;
            let start = Instant::now();
            for _ in 0..RUNS {
                if batched {
                    kernels
                        .sample_rows(&dl.as_view(), VOCAB, &draws, &mut out.as_view_mut())
                        .expect("sample_rows");
                } else {
                    for d in &draws {
                        kernels
                            .sample_rows(
                                &dl.as_view(),
                                VOCAB,
                                std::slice::from_ref(d),
                                &mut out.as_view_mut(),
                            )
                            .expect("sample_rows");
                    }
                }
                stream.clone_dtoh(&out).expect("device to host");
            }
            start.elapsed().as_secs_f64() * 1e6 / RUNS as f64
        };
        let (one_by_one, together) = (time(false), time(true));
        println!(
            "{ROWS} rows, top-k {top_k:?} top-p {top_p}: {one_by_one:.0} us one by one, \
             {together:.0} us in one set of launches (with a sync each)"
        );
    }
}
